"""Does the freed NCCL memory become rollout throughput? Megatron-LM's own RL
loop, KV-bound, with and without the package, in interleaved pairs.

    python3 experiments/rollout_gain.py plan [OUT] [--preset P]   # the arithmetic; no GPU
    python3 experiments/rollout_gain.py calibrate OUT [--preset P]   # the memory a run needs
    python3 experiments/rollout_gain.py search OUT [--preset P]   # the largest buffer without
    python3 experiments/rollout_gain.py curve OUT [--preset P] [--points 14.67 10.5:88]
    python3 experiments/rollout_gain.py run OUT --pairs 3 [--first 0] [--control] [--preset P]
        [--sides without,with | nogrow,with | nogrow,twin] [--only SIDE] [--gpus N]
    python3 experiments/rollout_gain.py merge OUT  # rollout_gain, critical_path, curve .json
    python3 experiments/rollout_gain.py plot OUT [--pair 0]   # memory over time of one pair

Set-up (COMMANDS.txt in the results folder says it again; experiments/NEXT_GPU_CAMPAIGN.md
has the device commands): one H200, 2 ranks on it (DP 2), NCCL 2.30.7 (torch
2.14's pin) preloaded, megatron-core 0.19.2 with Megatron-LM core_r0.19.0's
train_rl.py, --rl-kv-cache-management-mode recompute. The models (``--preset``,
experiments/presets.py, whose docstring has the arithmetic): ``qwen3_1_7b``,
Qwen3-1.7B's proportions with 513-token generations, and ``tiny_kv``, the first
experiment's KV-heavy toy, unchanged. Every rank first takes a fixed allocation that
stands for the rest of a larger job (``--leave-gb``: what is left per rank for this
run's model, optimizer, NCCL and KV cache; ``calibrate`` measures it); the KV buffer
without the package (``--buffer-gb``) is then about the largest that fits.

Sides (``--sides``, the baseline first):
- without: the buffer as given.
- with: the launcher, ``--rl-amem-offload-during-rollout --rl-amem-grow-kv-cache``:
  each rollout starts at once on the launch-size cache; where the package's
  decision says growing pays, the cache and the requests it runs at once grow into
  what the begin freed, between two engine steps, once the suspends are over.
- nogrow: the launcher without ``--rl-amem-grow-kv-cache`` (``--sides nogrow,with``
  asks what the default growth costs where it cannot pay).
- twin: nogrow again, under its own name (``--sides nogrow,twin``): two runs of one
  configuration, so their ratios are what the loop differs by from run to run, the floor
  under which a pair cannot tell one side from the other.
- control (``--control``): without the package, at the buffer the package
  reached: it must run out of memory or fail to launch.

``curve``: without the package and without the stand-in allocation (each run alone
on its GPU), one run per point (``BUFFER_GB[:MAX_REQUESTS]``), measuring tokens/s
against the requests in flight from every engine step; with ``calibrate``'s run (the
launch buffer) it shows whether more KV capacity gives more tokens/s.

What the figures mean (``figures``; every later rollout counts, the first one's cache
coming from the engine's launch, before anything is suspended):
  tokens_per_s        generated tokens / the rollout's wall time (rank 0's record,
                      from the request to the results)
  kv_token_capacity   (blocks - 1) x block tokens of the cache a rollout ended with
                      (a grown rollout holds two: the launch size, then the regrow)
  launch_kv_token_capacity, launch_max_requests   its first cache
  peak_in_flight      the most requests the engine ran in one step (each made a
                      token), the rank that ran most; mean_in_flight its
                      time-weighted mean
  wait_before_first_step_s   the request -> the first engine step's start, the slower rank
  wait_before_first_token_s  the request -> the end of the first engine step that made
                      tokens (its tokens exist then), the slower rank; the goal reads
                      the package's part of it, with minus without (Megatron's own
                      request handling and prefill are on both sides)
  wait_before_kv_s    the request -> its first KV allocation, the slower rank
  generation_s        that allocation -> results back, the slower rank
  step_s              iteration to iteration (rollout, log-probs, training)
  train_step_s        the training step proper, the slower rank
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from amem_callbacks.tools.pairs import Interleaved, MixedCommits, Pair, one_commit  # noqa: E402
from experiments import gpu_runs as runs  # noqa: E402
from experiments.largest_setting import Search  # noqa: E402

runs.require_installed_package()  # the presets' arithmetic is the adapter's own (installed)
from experiments import presets  # noqa: E402

GiB = presets.GiB
CUDA_CONTEXT = presets.CUDA_CONTEXT
GROW = ["--rl-amem-grow-kv-cache"]
#: side -> (through the package's launcher, with --rl-amem-grow-kv-cache)
SIDES = {"without": (False, False), "with": (True, True), "nogrow": (True, False),
         "twin": (True, False)}
#: done-when of the issue's realistic experiment (a with/without folder)
WAIT_GOAL_S, PAIRS_GOAL = 0.1, 3
#: the old experiment with the default growth against growth off (a nogrow/with folder)
GROWTH_COST_GOAL = 1.01


def preset_of(args) -> presets.Preset:
    return presets.PRESETS[args.preset].packed(args.sequences_per_bin).emptying(
        args.empty_unused_memory_level)


def flags(args, buffer_gb: float) -> list:
    return preset_of(args).train_rl_flags(args.iters, buffer_gb)


def start_run(args, name: str, side: str, buffer_gb: float, port: int, *, standin: bool = True,
              extra: list = (), gpu=None, stop_after: int = 0) -> runs.Run:
    amem, grow = SIDES[side]
    prefix = os.path.join(args.out, name)
    wrapper = preset_of(args).wrapper_flags(args.leave_gb if standin else None, stop_after)
    argv = runs.command(args.ranks, port, prefix, f"/tmp/amem-gain/{name}", amem,
                        flags(args, buffer_gb) + list(extra) + (GROW if grow else []), wrapper)
    env = {"AMEM_TEXT_GEN_PORT": str(port + 1)}
    if gpu is not None:  # a run of its own on one GPU of several: both ranks share it
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # this step's GPUs, if given
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
    return runs.Run(name, argv, prefix + ".log", args.timeout, runs.environment(env))


def finish_run(args, run: runs.Run) -> dict:
    outcome = run.wait()
    print(f"{run.name}: rc={outcome['rc']} in {outcome['seconds']} s"
          + (f" ({outcome['stopped']})" if outcome.get("stopped") else ""), flush=True)
    with open(os.path.join(args.out, run.name + ".outcome.json"), "w") as f:
        json.dump(outcome, f, indent=1)
    pack(args.out, args.pack_to)  # what has run so far survives a cut-off call
    return outcome


def one_run(args, name: str, side: str, buffer_gb: float, port: int, **kwargs) -> dict:
    return finish_run(args, start_run(args, name, side, buffer_gb, port, **kwargs))


# --- figures of one run ------------------------------------------------------
def _rows(record: dict) -> list:
    """The record's engine steps as dicts (megatron_rl_gpu.STEP_FIELDS)."""
    fields = record.get("engine_step_fields") or []
    return [dict(zip(fields, row)) for row in record.get("engine_steps") or []]


def _windows(record: dict) -> list:
    """(asked, back) of each rollout, in order, from the rank's events."""
    asked, out = None, []
    for name, at in record.get("events") or []:
        if name == "rollouts_asked":
            asked = at
        elif name == "rollouts_back" and asked is not None:
            out.append((asked, at))
            asked = None
    return out


def _allocations(record: dict) -> list:
    """Each rollout's KV allocations, by the rollout's index: grouped by iteration
    where the records say it (a grown rollout holds two), else one a rollout after
    the launch's (the first design's records)."""
    allocations = record.get("kv_cache_allocations") or []
    generations = record.get("generations") or []
    sized = [a for a in allocations if a.get("kv_bytes")]
    if generations and all("iteration" in g for g in generations) and all(
            "iteration" in a for a in allocations):
        return [[a for a in sized if a["iteration"] == g["iteration"]] for g in generations]
    return [sized[:1]] + [[a] for a in sized[1:]]


def _rollout(records: dict, k: int) -> dict:
    """Rollout ``k``'s figures from every rank's steps, the slower rank's where they
    differ (the step goes on when every rank is back)."""
    out = {"waits": [], "first_tokens": [], "first_steps": [], "peaks": [], "means": [],
           "tokens": 0, "spans": [], "bound": [], "steps": 0}
    for record in records.values():
        windows = _windows(record)
        if k >= len(windows):
            return {}
        asked, back = windows[k]
        steps = [s for s in _rows(record) if asked <= s["began"] <= back]
        if not steps:
            return {}
        out["waits"].append(steps[0]["began"] - asked)
        first_token = next((s for s in steps if s["tokens"] > 0), steps[0])
        out["first_tokens"].append(first_token["ended"] - asked)
        out["first_steps"].append(steps[0]["ended"] - steps[0]["began"])
        # in flight: the requests that ran in a step (each made one token)
        out["peaks"].append(max(s["tokens"] for s in steps))
        busy = sum(s["ended"] - s["began"] for s in steps)
        out["means"].append(sum(s["tokens"] * (s["ended"] - s["began"]) for s in steps) / busy
                            if busy > 0 else None)
        out["tokens"] += sum(s["tokens"] for s in steps)
        out["spans"].append(steps[-1]["ended"] - steps[0]["began"])
        out["bound"].append(sum(1 for s in steps if _short_of_room(s)) / len(steps))
        out["steps"] += len(steps)
        out["max_requests"] = max(out.get("max_requests", 0), max(s["max_requests"]
                                                                   for s in steps))
    return {"wait_before_first_step_s": max(out["waits"]),
            "wait_before_first_token_s": max(out["first_tokens"]),
            "first_step_s": max(out["first_steps"]), "peak_in_flight": max(out["peaks"]),
            "mean_in_flight": _mean(out["means"]),
            "step_tokens_per_s": out["tokens"] / max(out["spans"]) if max(out["spans"]) > 0
            else None, "bound_step_fraction": max(out["bound"]),
            "steps_max_requests": out["max_requests"]}


def _short_of_room(step: dict) -> bool:
    """A request waited while the engine was full (as the package's meter reads it:
    as many requests as max_requests, or no free block), or one was paused."""
    return step["paused"] > 0 or (step["waiting"] > 0 and (
        step["active"] + step["paused"] >= step["max_requests"] or step["free_blocks"] <= 0))


def figures(prefix: str) -> dict:
    """What one run measured (rank 0's view, GPU-wide where the GPU is shared)."""
    records = runs.load_records(prefix)
    outcome = runs.load_json(prefix + ".outcome.json") or {}
    out = {"rc": outcome.get("rc"), "seconds": outcome.get("seconds"),
           "complete": outcome.get("rc") == 0 and len(records) > 0,
           "oom": "out of memory" in (outcome.get("tail") or "").lower()
           or outcome.get("stopped") == runs.OOM}
    if not records:
        return out
    first = records[min(records)]
    out.update(_whole_run(records))
    later = first["generations"][1:]  # the first rollout's cache comes from the launch
    out["tokens_per_s"] = _median([g["generated_tokens"] / g["seconds"] for g in later])
    out["rollout_s"] = _median([g["seconds"] for g in later])
    out["generated_tokens"] = _median([g["generated_tokens"] for g in later])
    out["generated_tokens_per_request"] = _median(
        [g["generated_tokens"] / g["rollouts"] for g in later if g.get("rollouts")])
    out["evictions"] = [g["evictions"] for g in first["generations"]]
    kv = [a for a in _allocations(first)[1:len(first["generations"])] if a]
    if kv:
        out["kv_bytes"] = _median([a[-1]["kv_bytes"] for a in kv])
        # the largest cache any rollout reached (the decider may run some at the launch size)
        out["kv_bytes_max"] = max(a[-1]["kv_bytes"] for a in kv)
        out["kv_blocks"] = _median([a[-1]["blocks"] for a in kv])
        out["kv_token_capacity"] = _median([_capacity(a[-1]) for a in kv])
        out["max_requests"] = _median([a[-1]["max_requests"] for a in kv])
        out["launch_kv_token_capacity"] = _median([_capacity(a[0]) for a in kv])
        out["launch_max_requests"] = _median([a[0]["max_requests"] for a in kv])
        out["kv_allocations_per_rollout"] = [len(a) for a in kv]
    steps = [_rollout(records, k) for k in range(1, len(first["generations"]))]
    steps = [s for s in steps if s]
    for key in ("wait_before_first_step_s", "wait_before_first_token_s", "first_step_s",
                "peak_in_flight", "mean_in_flight", "step_tokens_per_s", "bound_step_fraction"):
        if steps:
            out[key] = _median([s[key] for s in steps])
    times = [it["time"] for it in first["iterations"]]
    out["step_s_each"] = [b - a for a, b in zip(times[1:], times[2:])] or \
        [b - a for a, b in zip(times, times[1:])]
    out["step_s"] = _median(out["step_s_each"])
    # what the run took an iteration, the mean over every iteration the marks bound: a
    # growth probe's iteration (rollout 1) counts, which step_s leaves out
    out["step_s_mean_all"] = _mean([b - a for a, b in zip(times, times[1:])])
    out.update(_phase_figures(records))
    last = records[max(records)]
    out["losses"] = [(it["iteration"], it["loss"]) for it in last["iterations"]]
    amem = first.get("amem") or {}
    if amem.get("installed"):
        out["first_token_after_suspends_s"] = _first_token_after_suspends(records)
        out.update(_transition_figures(amem, len(first["generations"])))
        out.update(_growth_figures(amem))
    return out


def _whole_run(records: dict) -> dict:
    """The figures a user's job sees, every rollout and iteration counted (the launch,
    the first rollout's warm-up and launch-size cache included): the slowest rank's
    start to last iteration, that over the iterations, and rank 0's tokens over its
    rollouts' seconds. None where the records predate the start mark."""
    spans = [r["iterations"][-1]["time"] - r["started"] for r in records.values()
             if r.get("iterations") and r.get("started") is not None]
    first = records[min(records)]
    generations = [g for g in first.get("generations") or [] if g.get("seconds")]
    seconds = sum(g["seconds"] for g in generations)
    whole = max(spans) if spans and len(spans) == len(records) else None
    return {"whole_run_s": whole,
            "whole_iteration_s": whole / len(first["iterations"]) if whole else None,
            "whole_rollout_tokens_per_s": sum(g["generated_tokens"] for g in generations)
            / seconds if seconds else None}


def _capacity(allocation: dict) -> int:
    return (allocation["blocks"] - 1) * allocation["block_tokens"]  # one dummy block


def _phase_figures(records: dict) -> dict:
    """Where each later rollout's time went, taking the slowest rank (the step goes
    on when every rank is back): the wait for its first KV allocation (the engine's
    resume; nothing waits for the suspends), then generating with the cache in place;
    and the training step proper (the rollout excluded)."""
    waits, generating = [], []
    marks = {rank: _event_times(r.get("events") or []) for rank, r in records.items()}
    rollouts = min((len(m) for m in marks.values()), default=0)
    for k in range(1, rollouts):  # the first cache comes from the engine's launch
        firsts = [(m[k][0], m[k][1][0], m[k][2]) for m in marks.values() if m[k][1]]
        if len(firsts) == len(marks):
            waits.append(max(allocated - asked for asked, allocated, _ in firsts))
            generating.append(max(back - allocated for _, allocated, back in firsts))
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
    after = _after_rollout(records)
    if after:
        out["after_rollout_s"] = _median(after)
    return out


def _after_rollout(records: dict) -> list:
    """Per later rollout, the slower rank: Megatron's data step (``get_grpo_data_iterator``)
    less the generation inside it: the log-prob passes, the resumes behind them and the
    guard's waits. With growth on or off it is the same work, so its spread between
    iterations is the loop's own noise, which the iteration-time ratio carries too."""
    per_rank = []
    for record in records.values():
        steps, generations = record.get("rollouts") or [], record.get("generations") or []
        per_rank.append([s["seconds"] - g["seconds"] for s, g in zip(steps, generations)][1:])
    return [max(each) for each in zip(*per_rank)] if per_rank else []


def _first_token_after_suspends(records: dict) -> list:
    """Per later rollout, the slower rank: its first token's time less the end of the
    suspends its begin started in that rollout (negative: the token came first; about 0:
    the first step did not end before the suspends did)."""
    windows = {rank: _windows(r) for rank, r in records.items()}
    out = []
    for k in range(1, min((len(w) for w in windows.values()), default=0)):
        lags = []
        for rank, record in records.items():
            asked, back = windows[rank][k]
            begins = [t for t in (record.get("amem") or {}).get("transitions", [])
                      if t.get("kind") == "begin" and not t.get("skipped")
                      and asked - 1.0 <= t.get("started", -1e18) <= back]
            steps = [s for s in _rows(record) if asked <= s["began"] <= back and s["tokens"] > 0]
            if begins and steps:
                lags.append(steps[0]["ended"] - (begins[0]["started"] + begins[0]["wall_seconds"]))
        if len(lags) == len(records):
            out.append(max(lags))
    return out


def _event_times(events: list) -> list:
    """Per rollout: (asked, [its KV allocations], back); a rollout may allocate twice."""
    out, current = [], None
    for name, at in events:
        if name == "rollouts_asked":
            current = [at, []]
        elif name == "kv_allocated" and current is not None:
            current[1].append(at)
        elif name == "rollouts_back" and current is not None:
            out.append((current[0], current[1], at))
            current = None
    return out


GUARD_WAIT = "amem/guard_wait/"  # + <group>/seconds: the package's per-group guard waits


def _transition_figures(amem: dict, rollouts: int) -> dict:
    """Begin/end wall times (worker) and the caller's waits, per rollout."""
    walls, held = {"begin": [], "end": []}, []
    for t in amem.get("transitions", []):
        if not t.get("skipped"):
            walls[t["kind"]].append(t["wall_seconds"])
            if t["kind"] == "begin":  # held until the engine's first tokens (wall includes it)
                held.append(t.get("held_seconds", 0.0))
    waits = amem.get("caller_waits", {})
    guard = amem.get("metrics", {}).get("amem/total/guard_wait_seconds", 0.0)
    n = max(1, rollouts)
    critical = (sum(waits.values()) + guard) / n
    wall = (sum(walls["begin"]) + sum(walls["end"])) / n
    return {"begin_wall_s": walls["begin"], "end_wall_s": walls["end"], "begin_held_s": held,
            "caller_wait_s": waits, "guard_wait_s": guard,
            "critical_path_s": critical, "transition_wall_s": wall,
            "critical_fraction": critical / wall if wall else None,
            "guard_resumes": amem.get("metrics", {}).get("amem/total/auto_resumes"),
            # which groups the step after a rollout waited for (calls, seconds)
            "guard_wait_by_group": {k[len(GUARD_WAIT):-len("/seconds")]: v
                                    for k, v in amem.get("metrics", {}).items()
                                    if k.startswith(GUARD_WAIT) and k.endswith("/seconds")},
            "kv_cache_reports": amem.get("kv_cache")}


def _growth_figures(amem: dict) -> dict:
    """What the package's growth did (rank 0's reports): when and how fast each grown
    cache came, the decisions, and what each later rollout's begin suspended."""
    reports = amem.get("kv_cache") or []
    grown = [r for r in reports if r.get("amem/kv_cache/grown")]
    growth = amem.get("kv_growth") or {}
    # the first begin comes at the engine's launch, before most communicators exist
    begins = [t.get("nccl_bytes") for t in amem.get("transitions", [])
              if t.get("kind") == "begin" and t.get("nccl_bytes")][1:]
    return {"grown_rollouts": len(grown),
            "grown_after_s": [r.get("amem/kv_cache/grown_after_s") for r in grown],
            "regrow_s": [r.get("amem/kv_cache/regrow_s") for r in grown],
            "decisions": [(d.get("amem/kv_cache/decision"), d.get("why"))
                          for d in growth.get("decisions") or []],
            "freed_bytes": _median(begins)}


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --- the sub-commands ---------------------------------------------------------
def run(args) -> int:
    """Pairs, then the control; stops early (whole pairs only) when the next pair
    would not end within ``--budget-s``, and at once when a run fails. With
    ``--gpus N`` (N >= 2) the two sides of a pair run at once on two GPUs, swapped
    from pair to pair, N // 2 pairs at a time: interleaved over GPUs, not over time."""
    runs.install_bundle()
    os.makedirs(args.out, exist_ok=True)
    sides = tuple(args.sides.split(","))
    port = 29700 + 20 * args.first
    began, durations = time.monotonic(), []
    per_wave = max(1, args.gpus // 2)
    index = args.first
    while index < args.first + args.pairs:
        typical = statistics.median(durations) if durations else 0.0
        if durations and time.monotonic() - began + typical > args.budget_s:
            print(f"budget: stopping before pair {index}", flush=True)
            break
        wave = range(index, min(args.first + args.pairs, index + per_wave))
        started = time.monotonic()
        for side, outcome in _pairs(args, wave, sides, port):
            if outcome["rc"] != 0:  # the set-up (baseline) or the package is wrong:
                print(f"the run {side} failed: stopping", flush=True)
                return 1  # nothing after it would mean anything; keep the device time
        durations.append(time.monotonic() - started)
        port += 4 * len(wave)
        index += len(wave)
    if args.control:
        grown = [figures(p[:-len(".outcome.json")]).get("kv_bytes_max")
                 for p in glob.glob(os.path.join(args.out, "pair*_with.outcome.json"))]
        grown = [g for g in grown if g]
        buffer_gb = (max(grown) / GiB) if grown else args.buffer_gb + args.control_extra_gb
        one_run(args, "control", "without", round(buffer_gb, 2), port)
    return 0


def _pairs(args, wave, sides: tuple, port: int) -> list:
    """The outcomes of the pairs in ``wave``, (side, outcome) each: one run after the
    other on one GPU, the baseline first in even pairs, up to the first that fails;
    else every run of the wave at once, each on its GPU, all waited for."""
    order = {i: sides if i % 2 == 0 else sides[::-1] for i in wave}
    if args.only:  # the pair's other side ran on a machine that went back mid-pair
        order = {i: tuple(s for s in order[i] if s == args.only) for i in wave}
    done = []
    if args.gpus < 2:
        for i in wave:
            for side in order[i]:
                done.append((side, one_run(args, f"pair{i}_{side}", side, args.buffer_gb, port)))
                port += 2
                if done[-1][1]["rc"] != 0:
                    return done
        return done
    started = []
    for slot, i in enumerate(wave):
        for gpu_offset, side in enumerate(order[i]):  # who leads takes the first GPU
            started.append((side, start_run(args, f"pair{i}_{side}", side, args.buffer_gb,
                                            port, gpu=2 * slot + gpu_offset)))
            port += 2
    return [(side, finish_run(args, run_)) for side, run_ in started]


def search(args) -> int:
    """The yardstick (issue 59): the largest KV buffer that runs without the package,
    on the grid --buffer-gb + k * --search-step (default: the calibration's slack) up
    to --search-high, bisected (experiments/largest_setting.py), one run at a time.
    Resumable: the runs already in OUT count. OUT/search.json keeps every trial, the
    failures included, and the largest buffer that ran: both sides of the pairs then
    launch at it (``run --buffer-gb``), the side with the package growing from it."""
    runs.install_bundle()
    os.makedirs(args.out, exist_ok=True)
    step = args.search_step or args.slack_gb
    found = Search(args.buffer_gb, step, max(args.buffer_gb, args.search_high
                                             or args.buffer_gb + 4 * step))
    names = {}
    for path in sorted(glob.glob(os.path.join(args.out, "search_without_*.outcome.json"))):
        prefix = path[:-len(".outcome.json")]
        value = float(os.path.basename(prefix).split("_")[2])
        found.record(value, _fits(figures(prefix)))
        names.setdefault(value, []).append(os.path.basename(prefix))
    port = 29600
    while found.next() is not None:
        value = found.next()
        tries = len(found.trials.get(value, []))
        name = f"search_without_{value:g}" + (f"_{tries}" if tries else "")
        one_run(args, name, "without", value, port)
        found.record(value, _fits(figures(os.path.join(args.out, name))))
        names.setdefault(value, []).append(name)
        port += 2
    result = dict(found.as_dict(), runs={str(v): n for v, n in sorted(names.items())},
                  preset=args.preset, best_buffer_gb=found.largest_fit)
    with open(os.path.join(args.out, "search.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("largest_fit", "smallest_fail", "stuck")}),
          flush=True)
    return 1 if found.stuck() or found.largest_fit is None else 0


def _fits(figures_: dict):
    """True where the run finished, False where it ran out of memory, else None (cut or
    crashed: it says nothing about fitting)."""
    if figures_.get("complete"):
        return True
    return False if figures_.get("oom") else None


def calibrate(args) -> int:
    """One run without the stand-in allocation: what each rank needed (torch's
    peak reservation plus NCCL's communicators plus the CUDA context), and the
    ``--leave-gb`` that leaves ``--slack-gb`` of it unused: less than the package
    frees, so the control's bigger buffer cannot fit, and more than the grown cache's
    extra attention memory, so the run with the package can. Per-rank figures. It is
    also the curve's point at the launch buffer."""
    runs.install_bundle()
    os.makedirs(args.out, exist_ok=True)
    outcome = one_run(args, "calibrate", "without", args.buffer_gb, 29690, standin=False)
    records = runs.load_records(os.path.join(args.out, "calibrate"))
    needs = {rank: (r.get("torch_max_reserved_bytes") or 0) + (r.get("nccl_total_bytes") or 0)
             + CUDA_CONTEXT for rank, r in records.items()}
    result = {"rc": outcome["rc"], "seconds": outcome["seconds"], "preset": args.preset,
              "buffer_gb": args.buffer_gb, "slack_gb": args.slack_gb,
              "need_gib_per_rank": {r: n / GiB for r, n in needs.items()},
              "generations": records.get(0, {}).get("generations"),
              "iterations": [it["time"] for it in records.get(0, {}).get("iterations", [])],
              "kv": records.get(0, {}).get("kv_cache_allocations")}
    # torch's reservation at each later rollout's KV allocation beyond the first's: the
    # training blocks it keeps cached. An allocation that fails makes torch free them and
    # try again, so a bigger cache without the package can take them: a leave counted
    # with them lets the control fit (measured: 10.6 GiB a rank, 2026-12-03)
    cached = {rank: _cached_training_bytes(r) for rank, r in records.items()}
    result["training_cache_at_rollout_gib"] = {r: c / GiB for r, c in cached.items()}
    if needs and outcome["rc"] == 0:
        result["leave_gb"] = round(max(needs.values()) / GiB + args.slack_gb, 2)
        if max(cached.values(), default=0) / GiB > args.slack_gb:
            result["control_can_take_the_training_cache"] = True
            print(f"calibrate: torch held up to {max(cached.values()) / GiB:.2f} GiB of "
                  f"training's blocks at a rollout, more than the {args.slack_gb:g} GiB slack: "
                  "the control can take them; --empty-unused-memory-level 2 releases them "
                  "after each training step", flush=True)
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps({k: result.get(k) for k in ("rc", "seconds", "need_gib_per_rank",
                                                 "leave_gb")}), flush=True)
    return 0 if "leave_gb" in result else 1


def _cached_training_bytes(record: dict) -> int:
    """The most torch held reserved at a later rollout's first KV allocation beyond what
    it held at the first rollout's (nothing trained yet)."""
    firsts = [a for a in (_allocations(record) or []) if a]
    reserved = [a[0].get("torch_reserved_bytes") for a in firsts]
    if len(reserved) < 2 or None in reserved:
        return 0
    return max(0, max(reserved[1:]) - reserved[0])


def parse_point(text: str) -> tuple:
    """``BUFFER_GB`` or ``BUFFER_GB:MAX_REQUESTS``."""
    buffer_gb, _, max_requests = text.partition(":")
    return float(buffer_gb), (int(max_requests) if max_requests else None)


def point_name(buffer_gb: float, max_requests) -> str:
    return f"curve_b{buffer_gb:g}" + (f"_mr{max_requests}" if max_requests else "")


def default_points(preset: presets.Preset) -> list:
    """The grown cache's size (what the package reaches), and the launch buffer at
    half its requests at once; the launch buffer itself is calibrate's run."""
    p = presets.plan(preset)
    grown_gb = math.ceil(p["grown"]["kv_bytes"] / GiB * 100) / 100
    return [f"{grown_gb:g}", f"{preset.buffer_gb:g}:{p['launch']['max_requests'] // 2}"]


def curve(args) -> int:
    """Tokens/s against requests in flight, without the package and without the
    stand-in allocation (each run alone on its GPU), then the curve's merge."""
    runs.install_bundle()
    os.makedirs(args.out, exist_ok=True)
    points = args.points or default_points(preset_of(args))
    port, failed = 29800, False
    for text in points:
        buffer_gb, max_requests = parse_point(text)
        name = point_name(buffer_gb, max_requests)
        extra = ["--inference-dynamic-batching-max-requests", str(max_requests)] \
            if max_requests else []
        outcome = one_run(args, name, "without", buffer_gb, port, standin=False, extra=extra,
                          stop_after=args.stop_after)
        failed |= outcome["rc"] != 0
        port += 2
    print(json.dumps(merge_curve(args.out, args.curve_rollout), indent=1, default=str))
    return 1 if failed else 0


def curve_point(prefix: str, rollout: int) -> dict:
    """One run's point: rollout ``rollout``'s steps (the first one's too: its steps
    come after the servers' start-up, which ``tokens_per_s`` would count)."""
    records = runs.load_records(prefix)
    if not records:
        return {}
    first = records[min(records)]
    kv = _allocations(first)
    point = _rollout(records, rollout)
    if not point:
        return {}
    allocation = kv[rollout][-1] if rollout < len(kv) and kv[rollout] else {}
    return dict(point, run=os.path.basename(prefix), kv_bytes=allocation.get("kv_bytes"),
                blocks=allocation.get("blocks"), max_requests=allocation.get("max_requests"),
                token_capacity=_capacity(allocation) if allocation else None,
                evictions=first["generations"][rollout].get("evictions"),
                generated_tokens_per_request=first["generations"][rollout][
                    "generated_tokens"] / max(1, first["generations"][rollout]["rollouts"]))


def per_step_curve(prefixes: list, bins: int = 8) -> list:
    """Tokens/s of every step of the given runs, by requests in flight (bins)."""
    steps = [s for prefix in prefixes for record in runs.load_records(prefix).values()
             for s in _rows(record) if s["ended"] > s["began"] and s["tokens"] > 0]
    if not steps:
        return []
    top = max(s["tokens"] for s in steps)
    width = max(1, math.ceil(top / bins))
    out = {}
    for s in steps:
        b = out.setdefault((s["tokens"] - 1) // width, [0, 0.0, 0])
        b[0] += s["tokens"]
        b[1] += s["ended"] - s["began"]
        b[2] += 1
    return [{"in_flight": [k * width + 1, (k + 1) * width], "steps": n,
             "tokens_per_s_per_rank": tokens / seconds}
            for k, (tokens, seconds, n) in sorted(out.items())]


def merge_curve(out: str, rollout: int = 0) -> dict:
    """curve.json: the points (calibrate's run is the launch buffer's), sorted by
    requests in flight, and whether tokens/s rises with them up to the KV limit."""
    prefixes = [p[:-len(".outcome.json")] for p in sorted(
        glob.glob(os.path.join(out, "curve_*.outcome.json")) +
        glob.glob(os.path.join(out, "calibrate.outcome.json")))]
    points = [p for p in (curve_point(prefix, rollout) for prefix in prefixes) if p]
    points.sort(key=lambda p: (p["peak_in_flight"], p["step_tokens_per_s"] or 0))
    result = {"rollout": rollout, "points": points,
              "per_step": per_step_curve(prefixes)}
    if len(points) >= 2:
        rates = [p["step_tokens_per_s"] for p in points]
        result["rises_with_concurrency"] = all(b >= 0.98 * a for a, b in zip(rates, rates[1:])) \
            and rates[-1] > rates[0]
        # the launch buffer's own point: the engine's default max_requests, requests waiting
        launch = launch_point(points, _launch_run(out))
        bigger = [p for p in points if launch is not None and (p.get("token_capacity") or 0)
                  > (launch.get("token_capacity") or 0)]
        if launch is not None and bigger:
            top = max(bigger, key=lambda p: p["token_capacity"])
            capacity = top["token_capacity"] / launch["token_capacity"]
            best = top["step_tokens_per_s"] / launch["step_tokens_per_s"]
            result.update(
                capacity_ratio=capacity, best_case_tokens_per_s_ratio=best,
                kv_limited_at_launch=launch["bound_step_fraction"] > 0 and best > 1.0,
                tokens_goal=1 + 0.5 * (capacity - 1), pairs_can_meet_the_tokens_goal=best >= 1
                + 0.5 * (capacity - 1))
        result["verdict"] = _curve_verdict(result)
    with open(os.path.join(out, "curve.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def _launch_run(out: str) -> str:
    """The curve's own run at calibrate's buffer (``--points`` can name it), if any."""
    try:
        with open(os.path.join(out, "calibration.json")) as f:
            return point_name(float(json.load(f)["buffer_gb"]), None)
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def launch_point(points: list, own_run: str = "") -> dict:
    """The launch size's point: the curve's own run of it where there is one, else
    calibrate's. Both run the same buffer and flags; the curve's own was timed alone on
    the GPU, while calibrate may share the machine with other work (it is a memory
    measurement first): a slower launch point would overstate the gain."""
    by_run = {p["run"]: p for p in points}
    return by_run.get(own_run) or by_run.get("calibrate")


def _curve_verdict(result: dict) -> str:
    if "kv_limited_at_launch" not in result:
        return ("tokens/s rises with requests in flight" if result["rises_with_concurrency"]
                else "tokens/s does not rise with requests in flight") + \
            " (no launch-buffer point from calibrate: KV limit not judged)"
    if not result["kv_limited_at_launch"]:
        return "not KV-limited: no request waited for room at the launch size, or more KV " \
               "capacity gave no more tokens/s"
    line = (f"KV-limited: requests waited for room at the launch size and x"
            f"{result['capacity_ratio']:.2f} capacity gave x"
            f"{result['best_case_tokens_per_s_ratio']:.2f} tokens/s")
    if not result["pairs_can_meet_the_tokens_goal"]:
        line += (f", below the pairs' goal x{result['tokens_goal']:.2f} even with no regrow "
                 "cost: the pairs cannot meet it")
    return line


def merge(args) -> int:
    out = args.out
    sides = _sides_in(out)
    commits = {os.path.basename(path)[:-len(".json")]: (runs.load_json(path) or {}).get("commit")
               for path in glob.glob(os.path.join(out, "*.rank*.json"))}
    try:
        commit = one_commit(commits, args.mixed_commits_why)
    except MixedCommits as exc:
        raise SystemExit(str(exc)) from None
    pairs = []
    for index in range(100):
        paths = {s: os.path.join(out, f"pair{index}_{s}") for s in sides}
        if not all(os.path.exists(p + ".outcome.json") for p in paths.values()):
            continue
        order = sides if index % 2 == 0 else sides[::-1]
        results = {s: figures(p) for s, p in paths.items()}
        pairs.append(Pair(index, order, results, {s: r.get("seconds") for s, r in results.items()}))
    result = Interleaved(sides=sides, pairs=pairs)
    control = figures(os.path.join(out, "control")) if os.path.exists(
        os.path.join(out, "control.outcome.json")) else None
    commands = sorted({(runs.load_json(p) or {}).get("command", "") for p in
                       glob.glob(os.path.join(out, "*.outcome.json"))})
    gain = gain_summary(result, control, commands)
    gain.update(commit=commit, mixed_commits_why=args.mixed_commits_why)
    with open(os.path.join(out, "rollout_gain.json"), "w") as f:
        json.dump(gain, f, indent=1, default=str)
    withs = [p.results[sides[1]] for p in pairs if p.results[sides[1]].get("critical_path_s")]
    critical = {"loop": "Megatron-LM train_rl.py, megatron-core 0.19.2, DP 2 on one GPU; each "
                        "rollout starts at once on the launch-size KV cache, which grows between "
                        "two engine steps once the suspends are over, where growing pays",
                "sides": list(sides),
                "critical_path_s": _median([w["critical_path_s"] for w in withs]),
                "transition_wall_s": _median([w["transition_wall_s"] for w in withs]),
                "critical_fraction": _median([w["critical_fraction"] for w in withs]),
                "step_time_ratio": result.ratio("step_s"), "pairs": len(pairs),
                "wait_before_first_token_s": gain["wait_before_first_token_s"],
                "extra_wait_before_first_token_s": gain["extra_wait_before_first_token_s"],
                "first_step_s": gain["first_step_s"],
                # about 0: the first token waited for the suspends, overlap or not
                "first_token_after_suspends_s": [w.get("first_token_after_suspends_s")
                                                 for w in withs],
                "per_run": withs, "commands": commands}
    with open(os.path.join(out, "critical_path.json"), "w") as f:
        json.dump(critical, f, indent=1, default=str)
    if glob.glob(os.path.join(out, "curve_*.outcome.json")):
        merge_curve(out, args.curve_rollout)
    if pairs:
        plot_pair(out, pairs[0].index)
    print(json.dumps({k: gain[k] for k in (
        "capacity_ratio", "rollout_tokens_per_s_ratio", "concurrency_ratio",
        "wait_before_first_token_s", "step_time_ratio", "control_fails", "goals")},
        indent=1, default=str))
    return 0


def _sides_in(out: str) -> tuple:
    """(baseline, compared) of this folder's pairs, as its runs' names say."""
    if glob.glob(os.path.join(out, "pair*_twin.outcome.json")):
        return ("nogrow", "twin")
    if glob.glob(os.path.join(out, "pair*_nogrow.outcome.json")):
        return ("nogrow", "with")
    return ("without", "with")


def gain_summary(result: Interleaved, control, commands: list) -> dict:
    """rollout_gain.json: the first design's keys, the new design's figures, and the
    issue's done-when, each goal None where a figure is missing."""
    base, other = result.sides
    capacity = result.ratio("kv_token_capacity")
    tokens = result.ratio("tokens_per_s")
    step = result.ratio("step_s")
    concurrency = result.ratio("peak_in_flight")

    def per_side(key):
        return {side: _median([p.results[side].get(key) for p in result.pairs])
                for side in result.sides}

    waits = per_side("wait_before_first_token_s")
    phases = {key: per_side(key) for key in (
        "generation_s", "after_rollout_s", "train_step_s", "step_s")}
    extra_wait = None if None in waits.values() else waits[other] - waits[base]
    gain = {
        "sides": list(result.sides),
        # the headline: whole runs, the first rollout included (with / without, medians
        # of the pairs); every key after this block is the steady state (rollout 0 out)
        "whole_run": {key: {"ratio": result.ratio(key), "spread": result.spread(key),
                            "per_side": per_side(key)}
                      # seconds: the job's launch to its exit, as its outcome timed it
                      for key in ("whole_run_s", "whole_iteration_s",
                                  "whole_rollout_tokens_per_s", "seconds")},
        "capacity_ratio": capacity, "capacity_ratio_spread": result.spread("kv_token_capacity"),
        "rollout_tokens_per_s_ratio": tokens,
        "rollout_tokens_per_s_ratio_spread": result.spread("tokens_per_s"),
        "step_time_ratio": step, "step_time_ratio_spread": result.spread("step_s"),
        # the rollout's wall split: the wait for its first KV allocation, then generation
        "generation_tokens_per_s_ratio": result.ratio("generation_tokens_per_s"),
        "generation_tokens_per_s_ratio_spread": result.spread("generation_tokens_per_s"),
        "generation_s_ratio": result.ratio("generation_s"),
        "wait_before_kv_s": per_side("wait_before_kv_s"),
        "train_step_time_ratio": result.ratio("train_step_s"),
        # the iteration's three parts, per side (medians of the pairs): growth changes the
        # generation only; the other two are the same work on both sides
        "iteration_phases": {side: {key: medians[side] for key, medians in phases.items()}
                             for side in result.sides},
        # every measured iteration of every pair, pooled: compared mean / baseline mean
        "step_time_ratio_pooled": _ratio(
            _mean([t for p in result.pairs for t in p.results[other].get("step_s_each") or []]),
            _mean([t for p in result.pairs for t in p.results[base].get("step_s_each") or []])),
        # the new design: concurrency follows the blocks, nothing waits before generating
        "concurrency_ratio": concurrency,
        "concurrency_ratio_spread": result.spread("peak_in_flight"),
        "mean_concurrency_ratio": result.ratio("mean_in_flight"),
        "max_requests_ratio": result.ratio("max_requests"),
        "max_requests": per_side("max_requests"),
        "launch_max_requests": per_side("launch_max_requests"),
        "peak_in_flight": per_side("peak_in_flight"),
        "wait_before_first_step_s": per_side("wait_before_first_step_s"),
        "wait_before_first_token_s": waits,
        "extra_wait_before_first_token_s": extra_wait,
        "first_step_s": per_side("first_step_s"),
        "step_tokens_per_s_ratio": result.ratio("step_tokens_per_s"),
        "rollout_s": per_side("rollout_s"),
        "generated_tokens_per_request": per_side("generated_tokens_per_request"),
        # what a rollout's begin suspended a rank, against the baseline's cache
        "freed_fraction_of_kv": _ratio(_median([p.results[other].get("freed_bytes")
                                                for p in result.pairs]),
                                       _median(result.values(base, "kv_bytes"))),
        "grown_after_s": [p.results[other].get("grown_after_s") for p in result.pairs],
        "regrow_s": [p.results[other].get("regrow_s") for p in result.pairs],
        "decisions": [p.results[other].get("decisions") for p in result.pairs],
        "control_fails": None if control is None else not control.get("complete"),
        "control": control, "pairs": result.as_dict()["pairs"], "commands": commands,
    }
    goals = {"tokens_gain_at_least_0.8_of_capacity_gain":
             None if None in (capacity, tokens) else tokens - 1 >= 0.8 * (capacity - 1),
             "step_faster_with": None if step is None else step < 1.0}
    if base == "without":
        goals.update({
            "concurrency_ratio_at_least_0.9_of_capacity_ratio":
                None if None in (capacity, concurrency) else concurrency >= 0.9 * capacity,
            "tokens_per_s_ratio_at_least_1_plus_half_the_capacity_gain":
                None if None in (capacity, tokens) else tokens >= 1 + 0.5 * (capacity - 1),
            # the package's part: the side without it waits as long for Megatron's own
            # request handling and prefill step (about 1.1 s measured on Qwen3's preset)
            f"extra_wait_before_first_token_at_most_{WAIT_GOAL_S}_s":
                None if extra_wait is None else extra_wait <= WAIT_GOAL_S,
            "iteration_time_ratio_below_1": None if step is None else step < 1.0,
            "control_fails": gain["control_fails"],
            f"at_least_{PAIRS_GOAL}_pairs": len(result.pairs) >= PAIRS_GOAL})
        asked = generation_length(commands)
        gain["generation_length_tokens"] = asked
        gain["set_up"] = {
            # the length every request is asked to generate; a sampled model ends a few
            # early (random weights: 511.6 of 513 a request measured), so the measured
            # mean must reach 99 % of it, not the bound itself
            "generations_of_at_least_512_tokens": None if asked is None else asked >= 512
            and bool(_at_least(gain["generated_tokens_per_request"], 0.99 * asked)),
            "rollouts_of_at_least_30_s_without": _at_least(
                {base: gain["rollout_s"][base]}, 30),
            "freed_nccl_15_to_50_percent_of_kv": None if gain["freed_fraction_of_kv"] is None
            else 0.15 <= gain["freed_fraction_of_kv"] <= 0.5}
    else:
        # every iteration counts here, the growth probe's too: its cost is the default's
        every = result.ratio("step_s_mean_all")
        gain["step_time_ratio_all_iterations"] = every
        gain["step_time_ratio_all_iterations_spread"] = result.spread("step_s_mean_all")
        if other == "twin":
            # no goal: both sides are one configuration; what they differ by is the
            # loop's own run-to-run swing, the floor for the growth-cost goal's ratio
            goals = {}
            gain["same_configuration"] = True
        else:
            goals[f"iteration_time_at_most_{GROWTH_COST_GOAL}_of_growth_off"] = \
                None if every is None else every <= GROWTH_COST_GOAL
    gain["goals"] = goals
    return gain


def generation_length(commands: list):
    """The tokens a request may generate, from the runs' command lines: the
    sequence (``--inference-max-seq-length``) less the test agent's prompt; None where
    the lines disagree or do not say."""
    seqs = set()
    for command in commands:
        words = command.split()
        if "--inference-max-seq-length" in words:
            seqs.add(int(words[words.index("--inference-max-seq-length") + 1]))
    return seqs.pop() - presets.PROMPT_TOKENS if len(seqs) == 1 else None


def _ratio(a, b):
    return None if a is None or not b else a / b


def _at_least(values: dict, bound: float):
    values = [v for v in values.values() if v is not None]
    return None if not values else min(values) >= bound


# --- memory over time ---------------------------------------------------------------
def plot_pair(out: str, index: int = 0) -> str:
    """memory_pair{index}.png: the GPU's memory in use over time (rank 0's trace of
    the whole device) for both sides of a pair, each rollout shaded and each KV
    allocation marked. Without matplotlib, one line says so and memory_pair{index}.json
    holds the series (every 10th sample) and the marks."""
    series = {}
    for side in _sides_in(out):
        record = runs.load_records(os.path.join(out, f"pair{index}_{side}")).get(0)
        if not record or not record.get("memory_trace"):
            continue
        trace = record["memory_trace"]
        # in use = total - free; a record without the total: below the most ever free
        t0, total = trace[0][0], record.get("gpu_total_bytes") or max(f for _, f in trace)
        series[side] = {
            "t_s": [t - t0 for t, _ in trace], "used_gib": [(total - f) / GiB for _, f in trace],
            "rollouts": [(a - t0, b - t0) for a, b in _windows(record)],
            "kv_allocations": [(a["at"] - t0, a.get("kv_bytes", 0) / GiB)
                               for a in record.get("kv_cache_allocations") or [] if "at" in a]}
    if not series:
        print(f"plot: no memory trace in pair {index}'s records", flush=True)
        return ""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = os.path.join(out, f"memory_pair{index}.json")
        note = ("matplotlib is not installed here: no plot; this file holds the series "
                "(python3 -m pip install matplotlib, then run plot again)")
        with open(path, "w") as f:
            json.dump({"note": note, "series": {side: dict(s, t_s=s["t_s"][::10], used_gib=s[
                "used_gib"][::10]) for side, s in series.items()}}, f)
        print(f"plot: {note} -> {path}", flush=True)
        return path
    fig, axes = plt.subplots(len(series), 1, figsize=(11, 3.2 * len(series)), sharex=True,
                             squeeze=False)
    for ax, (side, s) in zip(axes[:, 0], series.items()):
        ax.plot(s["t_s"], s["used_gib"], lw=0.8, label="GPU memory in use (both ranks)")
        for a, b in s["rollouts"]:
            ax.axvspan(a, b, color="tab:green", alpha=0.12)
        for at, gib in s["kv_allocations"]:
            ax.axvline(at, color="tab:red", lw=0.6, ls="--")
            ax.annotate(f"KV {gib:.1f}", (at, ax.get_ylim()[1]), fontsize=7, rotation=90,
                        va="top", color="tab:red")
        ax.set_ylabel("GiB")
        ax.set_title(f"pair {index}, {side}: rollouts shaded, KV allocations dashed", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the trace began")
    fig.tight_layout()
    path = os.path.join(out, f"memory_pair{index}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}", flush=True)
    return path


def plan_command(args) -> int:
    p = presets.plan(preset_of(args), buffer_gb=args.buffer_gb)
    print("\n".join(presets.lines(p)), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(p, f, indent=1)
    return 0 if all(p["checks"].values()) else 1


def pack(out: str, to: str = None) -> None:
    """One archive: the device tool brings back at most 8 files."""
    target = os.path.join(to or out, "runs.tgz")
    part = f"{target}.{os.getpid()}.part"  # steps running at once share a folder
    with tarfile.open(part, "w:gz") as tar:
        for path in sorted(glob.glob(os.path.join(out, "**", "*"), recursive=True)):
            if not path.endswith((".tgz", ".part")) and os.path.isfile(path):
                tar.add(path, arcname=os.path.relpath(path, out))
    os.replace(part, target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("plan", "run", "search", "calibrate", "curve", "merge",
                                         "plot"))
    parser.add_argument("out", nargs="?", default=None)
    parser.add_argument("--preset", choices=sorted(presets.PRESETS), default="tiny_kv")
    parser.add_argument("--mixed-commits-why", metavar="TEXT",
                        help="merge: fold records of different commits, for this reason "
                             "(kept in rollout_gain.json)")
    parser.add_argument("--sequences-per-bin", type=int, default=1,
                        help="train in bins of this many sequences (Megatron's sequence "
                             "packing); 1: one sequence a micro-batch, as before")
    parser.add_argument("--empty-unused-memory-level", type=int, default=0,
                        help="Megatron's flag of that name, on every run: 2 empties torch's "
                             "cache after each training step, so training's freed blocks are "
                             "not held through the rollout for the control to take")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--first", type=int, default=0, help="index of the first pair")
    parser.add_argument("--control", action="store_true", help="run the control after the pairs")
    parser.add_argument("--sides", default="without,with",
                        choices=("without,with", "nogrow,with", "nogrow,twin"),
                        help="the baseline, then the compared side")
    parser.add_argument("--only", choices=tuple(SIDES), default=None,
                        help="run one side of each pair: the other side already ran (its machine "
                             "went back mid-pair); merge the two folders' files into one")
    parser.add_argument("--gpus", type=int, default=1,
                        help="GPUs on the machine: with 2 or more, a pair's sides run at once")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=None,
                        help="training iterations per run (default: the preset's)")
    parser.add_argument("--buffer-gb", type=float, default=None,
                        help="KV buffer without the package (default: the preset's)")
    parser.add_argument("--leave-gb", type=float, default=None,
                        help="memory each rank keeps for this run; the rest of its share of the "
                             "GPU is held by the stand-in allocation (default: the preset's)")
    parser.add_argument("--control-extra-gb", type=float, default=4.2)
    parser.add_argument("--search-step", type=float, default=None,
                        help="search: the grid's step in GB (default: the calibration's slack)")
    parser.add_argument("--search-high", type=float, default=None,
                        help="search: the grid's top in GB (default: four steps up)")
    parser.add_argument("--slack-gb", type=float, default=None,
                        help="calibrate: memory left unused by the run without the package "
                             "(default: the plan's)")
    parser.add_argument("--points", nargs="*", default=None, metavar="BUFFER_GB[:MAX_REQUESTS]",
                        help="curve: one run each (default: the grown size, and half the "
                             "launch size's requests at once)")
    parser.add_argument("--stop-after", type=int, default=1,
                        help="curve: rollouts a point's run measures before it exits")
    parser.add_argument("--curve-rollout", type=int, default=0,
                        help="curve: which rollout of each run is the point")
    parser.add_argument("--pair", type=int, default=0, help="plot: which pair")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--pack-to", default=None, help="also keep runs.tgz up to date here")
    parser.add_argument("--budget-s", type=float, default=1e9,
                        help="start no pair that would end after this many seconds")
    args = parser.parse_args(argv)
    try:
        preset = preset_of(args)
    except ValueError as error:
        parser.error(str(error))
    for name, default in (("iters", preset.iters), ("buffer_gb", preset.buffer_gb),
                          ("leave_gb", preset.leave_gb), ("timeout", preset.timeout_s)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.slack_gb is None:
        args.slack_gb = presets.plan(preset, buffer_gb=args.buffer_gb)["slack_gb"]
    if args.only and args.only not in args.sides.split(","):
        parser.error(f"--only {args.only} is not one of --sides {args.sides}: write "
                     f"--only {' or --only '.join(args.sides.split(','))}")
    if args.what != "plan" and not args.out:
        parser.error(f"{args.what} needs OUT")
    if args.search_step is not None and args.search_step <= 0:
        parser.error(f"--search-step {args.search_step}: write a step > 0 in GB, e.g. 0.5")
    return {"plan": plan_command, "run": run, "search": search, "calibrate": calibrate,
            "curve": curve,
            "merge": merge, "plot": lambda a: 0 if plot_pair(a.out, a.pair) else 1}[args.what](
        args)


if __name__ == "__main__":
    sys.exit(main())
