"""Does the freed NCCL memory become rollout throughput? Megatron-LM's own RL
loop, KV-bound, with and without the package, in interleaved pairs.

    python3 experiments/rollout_gain.py run OUT --pairs 3 [--first 0] [--control]
    python3 experiments/rollout_gain.py calibrate OUT        # how much memory a run needs
    python3 experiments/rollout_gain.py merge OUT            # rollout_gain.json, critical_path.json

Set-up (COMMANDS.txt in the results folder says it again): one H200, 2 ranks
on it (DP 2), NCCL 2.30.7 (torch 2.14's pin) preloaded, megatron-core 0.19.2
with Megatron-LM core_r0.19.0's train_rl.py, --rl-kv-cache-management-mode
recompute. Every rank first takes a fixed allocation that stands for a larger
model's weights and optimizer state (``--leave-gb``: what is left per rank for
this run's model, optimizer, NCCL and KV cache); the KV buffer without the
package (``--buffer-gb``) is then about the largest that fits. The model is
built for a KV-heavy rollout: few layers and parameters, a wide KV (224 heads
x 256 channels over 8 layers, 1.8 MB per token; learned positions, since
rotary embeddings need kv_channels x heads = hidden), a 32k vocabulary so a random
model rarely ends early, short sequences, many prompts: the number of
requests an engine can hold limits the rollout.

- without: the buffer as given.
- with: the launcher, ``--rl-amem-offload-during-rollout --rl-amem-grow-kv-cache``;
  from the second rollout on (the first allocation comes at the engine's
  launch, before anything is suspended) the KV cache gets what the begin freed.
- control (``--control``): without the package, at the buffer the package
  reached: it must run out of memory or fail to launch.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from amem_callbacks.tools.pairs import Interleaved, Pair  # noqa: E402
from tests.gpu import megatron_runs as runs  # noqa: E402

GiB = 2**30
CUDA_CONTEXT = int(0.6 * GiB)  # a CUDA context on an H200 with torch 2.11 (not in torch's figures)
# The rollout: P x G requests per rollout, 64-token sequences in 32-token blocks
# (two blocks a request), one rollout per iteration.
MODEL = ("--num-layers 8 --hidden-size 256 --num-attention-heads 224 --kv-channels 256 "
         "--ffn-hidden-size 512 --seq-length 64 --max-position-embeddings 64 "
         "--position-embedding-type learned_absolute "
         "--inference-max-seq-length 64 --inference-dynamic-batching-block-size 32 "
         "--grpo-prompts-per-step 64 --grpo-group-size 8 --global-batch-size 512 "
         "--micro-batch-size 1 --use-distributed-optimizer --overlap-grad-reduce "
         "--overlap-param-gather").split()
WRAPPER = ["--amem-vocab", "32000", "--amem-memory-trace", "0.05"]
GROW = ["--rl-amem-grow-kv-cache"]


def flags(args, buffer_gb: float) -> list:
    return MODEL + ["--train-iters", str(args.iters),
                    "--inference-dynamic-batching-buffer-size-gb", f"{buffer_gb:g}"]


def one_run(args, name: str, amem: bool, buffer_gb: float, port: int, standin: bool = True):
    prefix = os.path.join(args.out, name)
    wrapper = WRAPPER + (["--amem-leave-gb", f"{args.leave_gb:g}"] if standin else [])
    argv = runs.command(args.ranks, port, prefix, f"/tmp/amem-gain/{name}", amem,
                        flags(args, buffer_gb) + (GROW if amem and not args.no_grow else []),
                        wrapper)
    env = runs.environment({"AMEM_TEXT_GEN_PORT": str(port + 1)})
    outcome = runs.Run(name, argv, prefix + ".log", args.timeout, env).wait()
    print(f"{name}: rc={outcome['rc']} in {outcome['seconds']} s", flush=True)
    with open(prefix + ".outcome.json", "w") as f:
        json.dump(outcome, f, indent=1)
    pack(args.out, args.pack_to)  # what has run so far survives a cut-off call
    return outcome


# --- figures of one run ------------------------------------------------------
def figures(prefix: str) -> dict:
    """What one run measured (rank 0's view, GPU-wide where the GPU is shared)."""
    records = runs.load_records(prefix)
    outcome = _load(prefix + ".outcome.json") or {}
    out = {"rc": outcome.get("rc"), "seconds": outcome.get("seconds"),
           "complete": outcome.get("rc") == 0 and len(records) > 0,
           "oom": "out of memory" in (outcome.get("tail") or "").lower()}
    if not records:
        return out
    first = records[min(records)]
    later = first["generations"][1:]  # the first rollout's cache comes from the launch
    out["tokens_per_s"] = _median([g["generated_tokens"] / g["seconds"] for g in later])
    out["rollout_s"] = _median([g["seconds"] for g in later])
    out["generated_tokens"] = _median([g["generated_tokens"] for g in later])
    out["evictions"] = [g["evictions"] for g in first["generations"]]
    kv = [a for a in first["kv_cache_allocations"][1:] if a.get("kv_bytes")]
    if kv:
        out["kv_bytes"] = _median([a["kv_bytes"] for a in kv])
        out["kv_blocks"] = _median([a["blocks"] for a in kv])
        out["kv_token_capacity"] = _median([(a["blocks"] - 1) * a["block_tokens"] for a in kv])
        out["max_requests"] = kv[-1]["max_requests"]
    times = [it["time"] for it in first["iterations"]]
    out["step_s"] = _median([b - a for a, b in zip(times[1:], times[2:])] or
                            [b - a for a, b in zip(times, times[1:])])
    out.update(_phase_figures(records))
    last = records[max(records)]
    out["losses"] = [(it["iteration"], it["loss"]) for it in last["iterations"]]
    amem = first.get("amem") or {}
    if amem.get("installed"):
        out.update(_transition_figures(amem, len(first["generations"])))
    return out


def _phase_figures(records: dict) -> dict:
    """Where each later rollout's time went, taking the slowest rank (the step goes
    on when every rank is back): waiting for the KV allocation (with the package,
    the suspends it waits for), then generating with the cache in place; and the
    training step proper (the rollout excluded)."""
    waits, generating = [], []
    marks = {rank: _event_times(r.get("events") or []) for rank, r in records.items()}
    rollouts = min((len(m["rollouts_back"]) for m in marks.values()), default=0)
    for k in range(1, rollouts):  # the first cache comes from the engine's launch
        waits.append(max(m["kv_allocated"][k] - m["rollouts_asked"][k] for m in marks.values()))
        generating.append(max(m["rollouts_back"][k] - m["kv_allocated"][k]
                              for m in marks.values()))
    out = {}
    if generating:
        tokens = records[min(records)]["generations"][1:]
        out["wait_before_kv_s"] = _median(waits)
        out["generation_s"] = _median(generating)
        out["generation_tokens_per_s"] = _median(
            [g["generated_tokens"] / s for g, s in zip(tokens, generating)])
    trains = [r.get("train_step_seconds") or [] for r in records.values()]
    if all(trains):
        out["train_step_s"] = _median([max(step) for step in zip(*trains)])
    return out


def _event_times(events: list) -> dict:
    times = {"rollouts_asked": [], "kv_allocated": [], "rollouts_back": []}
    for name, at in events:
        if name in times:
            times[name].append(at)
    return times


def _transition_figures(amem: dict, rollouts: int) -> dict:
    """Begin/end wall times (worker) and the caller's waits, per rollout."""
    walls = {"begin": [], "end": []}
    for t in amem.get("transitions", []):
        if not t.get("skipped"):
            walls[t["kind"]].append(t["wall_seconds"])
    waits = amem.get("caller_waits", {})
    guard = amem.get("metrics", {}).get("amem/total/guard_wait_seconds", 0.0)
    n = max(1, rollouts)
    critical = (sum(waits.values()) + guard) / n
    wall = (sum(walls["begin"]) + sum(walls["end"])) / n
    return {"begin_wall_s": walls["begin"], "end_wall_s": walls["end"],
            "caller_wait_s": waits, "guard_wait_s": guard,
            "critical_path_s": critical, "transition_wall_s": wall,
            "critical_fraction": critical / wall if wall else None,
            "guard_resumes": amem.get("metrics", {}).get("amem/total/auto_resumes"),
            "kv_cache_reports": amem.get("kv_cache")}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --- the sub-commands ---------------------------------------------------------
def run(args) -> int:
    """Pairs, then the control; stops early (whole pairs only) when the next pair
    would not end within ``--budget-s``, and at once when a run fails."""
    runs.install_bundle()
    os.makedirs(args.out, exist_ok=True)
    port = 29700 + 20 * args.first
    began, durations = time.monotonic(), []
    for index in range(args.first, args.first + args.pairs):
        typical = statistics.median(durations) if durations else 0.0
        if durations and time.monotonic() - began + 2 * typical > args.budget_s:
            print(f"budget: stopping before pair {index}", flush=True)
            break
        order = ("without", "with") if index % 2 == 0 else ("with", "without")
        for side in order:
            outcome = one_run(args, f"pair{index}_{side}", side == "with", args.buffer_gb, port)
            durations.append(outcome["seconds"])
            port += 2
            if outcome["rc"] != 0:  # the set-up (without) or the package (with) is wrong:
                print(f"the run {side} the package failed: stopping", flush=True)
                return 1  # nothing after it would mean anything; keep the device time
    if args.control:
        grown = [figures(p[:-len(".outcome.json")]).get("kv_bytes")
                 for p in glob.glob(os.path.join(args.out, "pair*_with.outcome.json"))]
        grown = [g for g in grown if g]
        buffer_gb = (max(grown) / GiB) if grown else args.buffer_gb + args.control_extra_gb
        one_run(args, "control", False, round(buffer_gb, 2), port)
    return 0


def calibrate(args) -> int:
    """One run without the stand-in allocation: what each rank needed (torch's
    peak reservation plus NCCL's communicators plus the CUDA context), and the
    ``--leave-gb`` that leaves about ``--slack-gb`` of it unused: less than the
    package frees, so the control's bigger buffer cannot fit. Per-rank figures,
    so it may run beside other work."""
    runs.install_bundle()
    os.makedirs(args.out, exist_ok=True)
    outcome = one_run(args, "calibrate", False, args.buffer_gb, 29690, standin=False)
    records = runs.load_records(os.path.join(args.out, "calibrate"))
    needs = {rank: (r.get("torch_max_reserved_bytes") or 0) + (r.get("nccl_total_bytes") or 0)
             + CUDA_CONTEXT for rank, r in records.items()}
    result = {"rc": outcome["rc"], "seconds": outcome["seconds"],
              "need_gib_per_rank": {r: n / GiB for r, n in needs.items()},
              "generations": records.get(0, {}).get("generations"),
              "iterations": [it["time"] for it in records.get(0, {}).get("iterations", [])],
              "kv": records.get(0, {}).get("kv_cache_allocations")}
    if needs:
        result["leave_gb"] = round(max(needs.values()) / GiB + args.slack_gb, 2)
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps({k: result.get(k) for k in ("rc", "seconds", "need_gib_per_rank",
                                                 "leave_gb")}), flush=True)
    return 0


def merge(args) -> int:
    pairs = []
    for index in range(100):
        sides = {s: os.path.join(args.out, f"pair{index}_{s}") for s in ("without", "with")}
        if not all(os.path.exists(p + ".outcome.json") for p in sides.values()):
            continue
        order = ("without", "with") if index % 2 == 0 else ("with", "without")
        results = {s: figures(p) for s, p in sides.items()}
        pairs.append(Pair(index, order, results, {s: r.get("seconds") for s, r in results.items()}))
    result = Interleaved(sides=("without", "with"), pairs=pairs)
    control = figures(os.path.join(args.out, "control")) if os.path.exists(
        os.path.join(args.out, "control.outcome.json")) else None
    commands = sorted({(_load(p) or {}).get("command", "") for p in
                       glob.glob(os.path.join(args.out, "*.outcome.json"))})
    capacity = result.ratio("kv_token_capacity")
    tokens = result.ratio("tokens_per_s")
    gain = {
        "capacity_ratio": capacity, "capacity_ratio_spread": result.spread("kv_token_capacity"),
        "rollout_tokens_per_s_ratio": tokens,
        "rollout_tokens_per_s_ratio_spread": result.spread("tokens_per_s"),
        "step_time_ratio": result.ratio("step_s"), "step_time_ratio_spread": result.spread("step_s"),
        # the rollout's wall split: the wait before the KV allocation, then generation
        "generation_tokens_per_s_ratio": result.ratio("generation_tokens_per_s"),
        "generation_tokens_per_s_ratio_spread": result.spread("generation_tokens_per_s"),
        "generation_s_ratio": result.ratio("generation_s"),
        "wait_before_kv_s": {side: _median([p.results[side].get("wait_before_kv_s")
                                            for p in pairs]) for side in ("without", "with")},
        "train_step_time_ratio": result.ratio("train_step_s"),
        "control_fails": None if control is None else not control.get("complete"),
        "control": control, "pairs": result.as_dict()["pairs"], "commands": commands,
        "goals": {"tokens_gain_at_least_0.8_of_capacity_gain":
                  None if None in (capacity, tokens) else tokens - 1 >= 0.8 * (capacity - 1),
                  "step_faster_with": None if result.ratio("step_s") is None else
                  result.ratio("step_s") < 1.0}}
    with open(os.path.join(args.out, "rollout_gain.json"), "w") as f:
        json.dump(gain, f, indent=1, default=str)
    withs = [p.results["with"] for p in pairs if p.results["with"].get("critical_path_s")]
    critical = {"loop": "Megatron-LM train_rl.py, megatron-core 0.19.2, DP 2 on one H200, KV "
                        "cache grown into the freed memory (the begin waits for the suspends "
                        "right before the KV allocation)",
                "critical_path_s": _median([w["critical_path_s"] for w in withs]),
                "transition_wall_s": _median([w["transition_wall_s"] for w in withs]),
                "critical_fraction": _median([w["critical_fraction"] for w in withs]),
                "step_time_ratio": result.ratio("step_s"), "pairs": len(pairs),
                "per_run": withs, "commands": commands}
    with open(os.path.join(args.out, "critical_path.json"), "w") as f:
        json.dump(critical, f, indent=1, default=str)
    print(json.dumps({k: gain[k] for k in (
        "capacity_ratio", "rollout_tokens_per_s_ratio", "generation_tokens_per_s_ratio",
        "wait_before_kv_s", "step_time_ratio", "train_step_time_ratio", "control_fails")},
        indent=1))
    return 0


def pack(out: str, to: str = None) -> None:
    """One archive: the device tool brings back at most 8 files."""
    target = os.path.join(to or out, "runs.tgz")
    with tarfile.open(target + ".part", "w:gz") as tar:
        for path in sorted(glob.glob(os.path.join(out, "**", "*"), recursive=True)):
            if not path.endswith((".tgz", ".part")) and os.path.isfile(path):
                tar.add(path, arcname=os.path.relpath(path, out))
    os.replace(target + ".part", target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("run", "calibrate", "merge"))
    parser.add_argument("out")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--first", type=int, default=0, help="index of the first pair")
    parser.add_argument("--control", action="store_true", help="run the control after the pairs")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3, help="training iterations per run")
    parser.add_argument("--buffer-gb", type=float, default=10.0)
    parser.add_argument("--leave-gb", type=float, default=22.0,
                        help="memory each rank keeps for this run; the rest of its share of the "
                             "GPU is held by the stand-in allocation")
    parser.add_argument("--control-extra-gb", type=float, default=3.2)
    parser.add_argument("--slack-gb", type=float, default=0.75,
                        help="calibrate: memory left unused by the run without the package")
    parser.add_argument("--no-grow", action="store_true",
                        help="the package without --rl-amem-grow-kv-cache (critical path only)")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--pack-to", default=None, help="also keep runs.tgz up to date here")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="start no pair that would end after this many seconds")
    args = parser.parse_args(argv)
    return {"run": run, "calibrate": calibrate, "merge": merge}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
