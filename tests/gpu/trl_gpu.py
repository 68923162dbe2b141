"""TRL adapter on real NCCL: GRPO with DDP on 2 GPUs, with and without AMemCallback.

Command (2 GPUs; NCCL >= 2.29.7 preloaded; trl and datasets carried as wheels):
    mkdir -p /tmp/nccl && xz -dc .nccl/libnccl.so.2.xz > /tmp/nccl/libnccl.so.2
    export LD_PRELOAD=/tmp/nccl/libnccl.so.2
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/trl_gpu.py $OUT/trl_gpu.json

Wheels (.whl): trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
(datasets 5.2 also wants pyarrow>=24, fsspec<=2026.9.0, huggingface-hub>=1.31: the
GPU image has these packages; carry a newer one only if its version there is lower).

Four runs in the same processes, same seed, deterministic algorithms: baseline,
AMemCallback(backend="nccl"), the same with overlap=True, baseline again (a
control: if it differs from the first, the comparison says nothing). Checks:
- every generation suspends the world group (DDP's only NCCL group) and the
  device free memory rises by >= 99 % of its NCCL suspendable bytes, measured
  by the policy around the suspend and independently at model.generate;
- one begin/end per generation, no collective on a suspended group;
- losses and gradient norms identical to the baseline;
- step time with / without (goal <= 1.02), median over steps 2..N;
- the amem/... figures are in trainer.state.log_history.
Rank 0 writes every rank's figures and checks to OUT ("ok": all checks hold).
``--cpu-smoke`` runs the same plumbing on CPU over gloo with the noop backend
(the memory checks then fail by design): a check of the script, not a proof.
``AMEM_GPU_DRIVER_ON_CPU=1`` (tests/gpu/common.py's CPU mode, what
tests/test_gpu_drivers_on_cpu.py runs) is the same with the fake NCCL of
tests/fake_nccl instead of noop: groups are suspended and resumed, a
collective on a suspended one ends the rank, and the memory checks are listed
as not judged on CPU.

``--fsdp2``: the model is sharded with FSDP2 (accelerate, ``fsdp_version: 2``).
Generation then all-gathers parameters on the default group, so nothing may be
suspended: the checks become "the callback kept world, saying why, suspended
nothing, never resumed anything by the guard, and losses are identical".
Several ranks on one GPU: accelerate picks ``cuda:LOCAL_RANK``, so LOCAL_RANK
is set to the shared device here.

``--hsdp``: FSDP2 with HSDP through transformers' ``parallelism_config``
(accelerate ``ParallelismConfig(dp_replicate_size=2, dp_shard_size=world/2)``,
one ParallelismConfig for all four runs, so they share its mesh groups).
accelerate builds the mesh ("dp_replicate", "dp_shard"), flattens "dp",
"dp_shard_cp" and "dp_cp", and shards over ("dp_replicate", "dp_shard_cp"):
parameters are (Replicate(), Shard(0)). Generation all-gathers over
dp_shard_cp only, and transformers' generate all-reduces its finished flag on
world (synced_gpus); dp_replicate carries only the backward all-reduce.
Checks: the shard group is kept with its reason, world with the synced_gpus
reason, nothing else is kept, the dp_replicate group is suspended at every
generation, no guard resume (else the group and the call are in the JSON),
losses and gradient norms identical, one begin/end per generation, and the
GPU's free memory at model.generate (read between barriers of a gloo group, so
every rank has suspended) plus the ranks' reserved-memory change rises by
>= 90 % of the suspended NCCL bytes of all ranks sharing the GPU. Each begin's
and end's groups (name, key, size, action, reason, bytes), guard resumes, the
mesh layout (each dim's group key and ranks), the versions and the NCCL
environment go to OUT. Four ranks on one GPU (NCCL >= 2.30,
NCCL_MULTI_RANK_GPU_ENABLE=1):
    python3 -m torch.distributed.run --nproc-per-node 4 tests/gpu/trl_gpu.py OUT.json --hsdp \\
        --steps 3 --hidden 256 --layers 2 --completion-length 64 --batch 4
(--batch is both per_device_train_batch_size and num_generations: 4 ranks x 4
= 16 completions per step, 4 prompts of 4, divisible as GRPO requires). ``--small-buffers`` sets NCCL_BUFFSIZE=1 MiB and
NCCL_MAX_NCHANNELS=4 before NCCL starts (smaller communicators: faster
suspends with several ranks on one GPU, less memory to free).
On CPU (``--cpu-smoke``) accelerate drops FSDP (use_cpu gives DDP over gloo), so
only the plumbing runs there; tests/test_trl_groups.py covers the group choice
on real FSDP2 over gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def import_callback():
    """AMemCallback from the installed package (a bare tree stops with the install
    command: common.require_installed_package)."""
    from tests.gpu.common import require_installed_package

    require_installed_package()
    from amem_callbacks.adapters.trl import AMemCallback

    return AMemCallback


AMemCallback = import_callback()
from amem_callbacks import OffloadPolicy, name_group  # noqa: E402
from amem_callbacks.groups import register_roles  # noqa: E402
from tests.gpu.common import ON_CPU, StepTimer, cpu_notes, gloo_group, nccl_library, \
    policy_backend, provenance, set_aside_on_cpu  # noqa: E402

VOCAB = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(4093)]
BEGINS: list = []  # every begin report of the current run, in order
ENDS: list = []  # every end report of the current run, in order
SYNC = []  # [a gloo group over every rank]: barriers for GPU-wide memory readings
PARALLELISM = []  # [the ParallelismConfig every --hsdp run shares]
SYNC_ROLE = "trl_gpu_sync"  # kept: the spy's barriers run on it while generating
register_roles([SYNC_ROLE])
# the script's plumbing on CPU/gloo: with the noop backend, or (ON_CPU) the fake NCCL
SMOKE = "--cpu-smoke" in sys.argv or ON_CPU


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def model(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=args.hidden,
                         num_hidden_layers=args.layers, intermediate_size=args.hidden * 11 // 4,
                         num_attention_heads=16,
                         num_key_value_heads=4, max_position_embeddings=2048, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None, tie_word_embeddings=True,
                         attn_implementation="eager")
    return Qwen2ForCausalLM(config)


def dataset():
    from datasets import Dataset

    n = len(VOCAB) - 3
    return Dataset.from_dict({"prompt": [" ".join(f"w{(i * 131 + j * 17) % n}" for j in range(16))
                                         for i in range(1024)]})


def reward(completions, **kwargs):
    return [len(set(c.split())) / (1 + len(c.split())) for c in completions]


def synchronize() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def memory_now() -> dict:
    if SMOKE:
        return {"free": 0, "reserved": 0}
    torch.cuda.synchronize()
    return {"free": torch.cuda.mem_get_info()[0], "reserved": torch.cuda.memory_reserved()}


def sync_group():
    """A gloo group over every rank, created once (collective: every rank calls it
    at the same point, after the first trainer set the default group up)."""
    if not SYNC:
        SYNC.append(gloo_group())
        name_group(SYNC[0], SYNC_ROLE)
    return SYNC[0]


def spy_generation(trainer, samples: list, synced: bool = False) -> None:
    """Device memory when _generate starts (before the suspend) and when the model
    starts generating (after it): an independent reading of what was freed.
    ``synced``: read after a barrier of every rank, so that on a shared GPU every
    rank has suspended (and the GPU-wide free memory says so) when it is read."""
    outer, inner = trainer._generate, trainer.model.generate
    mark = {}

    def read():
        if synced:
            synchronize()
            dist.barrier(group=sync_group())
        return memory_now()

    def _generate(*args, **kwargs):
        mark["entry"] = read()
        return outer(*args, **kwargs)

    def generate(*args, **kwargs):
        if "entry" in mark:
            now = read()
            samples.append({"free_gain": now["free"] - mark["entry"]["free"],
                            "reserved_gain": now["reserved"] - mark["entry"]["reserved"]})
            mark.clear()
        return inner(*args, **kwargs)

    trainer._generate, trainer.model.generate = _generate, generate


def record_begins() -> None:
    """Every begin and end report of the policies (class-wide)."""
    for kind, reports in (("begin", BEGINS), ("end", ENDS)):
        original = getattr(OffloadPolicy, kind)

        def recorded(self, *args, _original=original, _reports=reports, **kwargs):
            report = _original(self, *args, **kwargs)
            _reports.append(report)
            return report

        setattr(OffloadPolicy, kind, recorded)


def group_rows(report) -> list:
    """Each group of a transition: name, key, size, action, reason, bytes."""
    return [{"name": g.name, "key": g.key, "size": g.size,
             "action": getattr(g.action, "value", str(g.action)), "reason": g.reason,
             "suspendable_bytes": g.suspendable_bytes, "seconds": g.seconds}
            for g in report.groups]


def parallelism_config(args):
    """The one ParallelismConfig of every --hsdp run: it builds its mesh once, so
    the four runs use the same groups (a new one per run would leave the previous
    runs' communicators around for the next run to suspend)."""
    if not PARALLELISM:
        from accelerate import ParallelismConfig

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world < 4 or world % 2:
            raise SystemExit(f"--hsdp needs an even number of ranks >= 4, got {world}")
        config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=world // 2)
        if SMOKE:  # accelerate refuses a ParallelismConfig on CPU (MULTI_CPU, no FSDP):
            # let it build the mesh anyway, so the smoke reads a real mesh; DDP trains
            config._validate_accelerator = lambda accelerator: None
        PARALLELISM.append(config)
    return PARALLELISM[0]


def mesh_layout(trainer) -> dict:
    """accelerate's mesh as this rank sees it: each dim's group, ranks, and whether it
    is the default group itself."""
    from torch.distributed import distributed_c10d as c10d

    mesh = getattr(trainer.accelerator, "torch_device_mesh", None)
    if mesh is None:
        return {}
    out = {}
    for dim in ("dp_replicate", "dp_shard", "dp", "dp_shard_cp", "dp_cp"):
        try:
            group = mesh[dim].get_group()
        except Exception as exc:  # noqa: BLE001 - a dim this torch or layout lacks
            out[dim] = {"error": str(exc)[:200]}
            continue
        out[dim] = {"key": group.group_name, "ranks": dist.get_process_group_ranks(group),
                    "is_world": group is c10d._get_default_group(),
                    "desc": getattr(group, "group_desc", None)}
    out["fsdp_dims"] = list(PARALLELISM[0].fsdp_dim_names) if PARALLELISM else None
    param = next(trainer.model.parameters())
    out["param_placements"] = [str(p) for p in getattr(param, "placements", ())]
    out["param_mesh_dims"] = list(getattr(getattr(param, "device_mesh", None),
                                          "mesh_dim_names", None) or ())
    return out


def same_gpu_sums(values: list) -> list:
    """Element-wise sums of ``values`` over the ranks on this rank's GPU (collective)."""
    from amem_callbacks.placement import device_id

    mine = device_id(None if SMOKE else torch.cuda.current_device())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, list(values)), group=sync_group())
    rows = [v for dev, v in everyone if dev == mine]
    return [sum(row[i] for row in rows) for i in range(len(values))]


def fsdp2_options(args) -> dict:
    if not (args.fsdp2 or args.hsdp):
        return {}
    options = {"fsdp": True, "gradient_checkpointing": False,
               "fsdp_config": {"version": 2,
                               "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
                               "reshard_after_forward": True}}
    if args.hsdp:
        options["parallelism_config"] = parallelism_config(args)
    return options


def run(args, name: str, callback_options=None) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    BEGINS.clear()
    ENDS.clear()
    config = GRPOConfig(
        **fsdp2_options(args),
        output_dir=os.path.join("/tmp", "amem-trl-gpu", name), bf16=not SMOKE, use_cpu=SMOKE,
        per_device_train_batch_size=args.batch, num_generations=args.batch,
        max_completion_length=args.completion_length, max_steps=args.steps, logging_steps=1,
        report_to=[], save_strategy="no", seed=0, learning_rate=1e-5, beta=0.0,
        disable_tqdm=True, generation_kwargs={"min_new_tokens": args.completion_length})
    timer = StepTimer(synchronize)
    callbacks = [timer.callback]
    callback = None
    if callback_options is not None:
        callback = AMemCallback(**callback_options)
        callbacks.append(callback)
    trainer = GRPOTrainer(model=model(args), reward_funcs=reward, args=config,
                          train_dataset=dataset(), processing_class=tokenizer(),
                          callbacks=callbacks)
    if args.hsdp:
        sync_group()
    samples = []
    spy_generation(trainer, samples, synced=args.hsdp)
    trainer.train()
    mesh = mesh_layout(trainer) if args.hsdp else None  # the model is sharded in train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out = {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
           "step_seconds": timer.steps,
           "median_step_s": statistics.median(timer.steps[1:]) if len(timer.steps) > 1 else None}
    if mesh is not None:
        out["mesh"] = mesh
    if callback is not None:
        callback.policy.wait()
        moved = ("suspended", "would suspend") if SMOKE else ("suspended",)  # noop: would
        begins = [{"suspended": [g["name"] for g in group_rows(r) if g["action"] in moved],
                   "kept": [g.name for g in r.kept],
                   "nccl_bytes": r.nccl_bytes, "device_freed_bytes": r.device_freed_bytes,
                   "device_shared_by": r.device_shared_by, "seconds": r.total_seconds,
                   "skipped": r.skipped, "groups": group_rows(r)} for r in BEGINS]
        ends = [{"seconds": r.total_seconds, "groups": group_rows(r)} for r in ENDS]
        guard_resumes = [g for e in ends for g in e["groups"]
                         if g["reason"].startswith("resumed by the guard")]
        out.update(ends=ends, guard_resumes=guard_resumes)
        if args.hsdp:  # the GPU's ranks together: what they suspended, what they reserved
            out["gpu_nccl_bytes"] = same_gpu_sums([b["nccl_bytes"] for b in begins])
            out["gpu_reserved_gain"] = same_gpu_sums(
                [s["reserved_gain"] for s in samples] if len(samples) == len(begins)
                else [0] * len(begins))
        inert = bool(callback.policy.metrics()["amem/inert"])
        lib = nccl_library()
        out.update(begins=begins, independent=samples, kept=callback.kept,
                   # the backend as the last begin report names it (and, when the ranks
                   # found it unusable, why nothing was done), and the NCCL it calls
                   backend=BEGINS[-1].backend if BEGINS else None, inert=inert,
                   why_inert=BEGINS[-1].skipped if inert and BEGINS else None,
                   nccl_library=f"NCCL {lib.version_str} from {lib.path}" if lib else None,
                   counters=callback.policy.metrics(last=False),
                   end_seconds=callback.last_end.total_seconds if callback.last_end else None,
                   logged=[h.get("amem/total/begins") for h in logs])
        callback.detach()
    del trainer
    if not SMOKE:
        torch.cuda.empty_cache()
    return out


def checks_for(result: dict, args) -> dict:
    base, again = result["runs"]["baseline"], result["runs"]["baseline_again"]
    checks = {"control_baseline_repeats_exactly": base["loss"] == again["loss"]
              and base["grad_norm"] == again["grad_norm"]}
    if args.hsdp:
        return checks | hsdp_checks(result, args)
    if args.fsdp2:
        for name in ("amem", "amem_overlap"):
            runs = result["runs"][name]
            checks[f"{name}_world_kept_with_the_reason"] = "FSDP" in runs["kept"].get("world", "")
            checks[f"{name}_nothing_suspended"] = all(not b["suspended"] for b in runs["begins"])
            checks[f"{name}_no_guard_resume"] = runs["counters"]["amem/total/auto_resumes"] == 0
            checks[f"{name}_losses_identical"] = runs["loss"] == base["loss"]
        return checks
    for name in ("amem", "amem_overlap"):
        runs = result["runs"][name]
        begins = runs["begins"]
        checks[f"{name}_backend_active"] = not runs["inert"]
        checks[f"{name}_one_begin_end_per_generation"] = (
            runs["counters"]["amem/total/begins"] == runs["counters"]["amem/total/ends"]
            == args.steps == len(begins))
        checks[f"{name}_world_suspended_every_generation"] = all(
            b["suspended"] == ["world"] for b in begins)
        checks[f"{name}_no_collective_on_a_suspended_group"] = (
            runs["counters"]["amem/total/auto_resumes"] == 0)
        checks[f"{name}_losses_identical"] = runs["loss"] == base["loss"] and runs["grad_norm"] == \
            base["grad_norm"]
        checks[f"{name}_metrics_in_trainer_logs"] = runs["logged"] == list(range(1, args.steps + 1))
    sync = result["runs"]["amem"]
    checks["amem_freed_ge_99pct_of_suspendable"] = all(
        # None only where the package reads no device memory (CPU mode: not judged)
        b["nccl_bytes"] > 0 and (b["device_freed_bytes"] or 0) >= 0.99 * b["nccl_bytes"]
        for b in sync["begins"])
    checks["amem_independent_freed_ge_99pct"] = len(sync["independent"]) == args.steps and all(
        b["nccl_bytes"] > 0 and s["free_gain"] + s["reserved_gain"] >= 0.99 * b["nccl_bytes"]
        for s, b in zip(sync["independent"], sync["begins"]))
    return checks


#: per layout, the checks that read device memory (not judged in the CPU mode)
MEMORY_CHECKS = {"ddp": ("amem_freed_ge_99pct_of_suspendable", "amem_independent_freed_ge_99pct"),
                 "hsdp": ("amem_gpu_freed_ge_90pct_of_all_ranks_suspended",)}


def hsdp_checks(result: dict, args) -> dict:
    base = result["runs"]["baseline"]
    checks = {}
    for name in ("amem", "amem_overlap"):
        runs = result["runs"][name]
        begins, kept = runs["begins"], runs["kept"]
        checks[f"{name}_backend_active"] = not runs["inert"]
        checks[f"{name}_one_begin_end_per_generation"] = (
            runs["counters"]["amem/total/begins"] == runs["counters"]["amem/total/ends"]
            == args.steps == len(begins))
        checks[f"{name}_shard_group_kept_with_the_reason"] = any(
            "dp_shard" in group and why.startswith(
                "FSDP2 all-gathers parameters over mesh dim dp_shard")
            for group, why in kept.items())
        checks[f"{name}_world_kept_for_generate"] = "synced_gpus" in kept.get("world", "")
        # a kept group without a communicator (never used) holds nothing to free
        checks[f"{name}_nothing_else_kept"] = all(
            {g["name"] for g in b["groups"] if g["action"] == "kept" and g["suspendable_bytes"]}
            <= set(kept) | {SYNC_ROLE} for b in begins)
        checks[f"{name}_replicate_group_suspended_every_generation"] = bool(begins) and all(
            any("dp_replicate" in group for group in b["suspended"]) for b in begins)
        checks[f"{name}_no_guard_resume"] = (runs["counters"]["amem/total/auto_resumes"] == 0
                                            and not runs["guard_resumes"])
        checks[f"{name}_losses_identical"] = runs["loss"] == base["loss"] and runs["grad_norm"] == \
            base["grad_norm"]
        checks[f"{name}_metrics_in_trainer_logs"] = runs["logged"] == list(range(1, args.steps + 1))
    sync = result["runs"]["amem"]
    totals, reserved = sync["gpu_nccl_bytes"], sync["gpu_reserved_gain"]
    checks["amem_gpu_freed_ge_90pct_of_all_ranks_suspended"] = (
        len(sync["independent"]) == len(totals) == args.steps and all(t > 0 for t in totals)
        and all(s["free_gain"] + r >= 0.9 * t
                for s, r, t in zip(sync["independent"], reserved, totals)))
    return checks


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "transformers", "accelerate", "trl", "datasets"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--completion-length", type=int, default=384)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--fsdp2", action="store_true")
    parser.add_argument("--hsdp", action="store_true")
    parser.add_argument("--small-buffers", action="store_true")
    args = parser.parse_args()
    if args.small_buffers:  # before the first communicator exists
        os.environ.update(NCCL_BUFFSIZE=str(1 << 20), NCCL_MAX_NCHANNELS="4")
    backend = policy_backend("nccl") if ON_CPU else "noop" if SMOKE else "nccl"
    if not SMOKE:
        from tests.gpu.common import bind_device

        os.environ["LOCAL_RANK"] = str(bind_device())  # LOCAL_RANK % GPUs, for accelerate too
    torch.use_deterministic_algorithms(True, warn_only=True)
    record_begins()
    result = {"torch": torch.__version__, "versions": versions(), "args": vars(args),
              "env": {k: os.environ.get(k) for k in (
                  "NCCL_BUFFSIZE", "NCCL_MAX_NCHANNELS", "NCCL_MULTI_RANK_GPU_ENABLE",
                  "LD_PRELOAD", "LOCAL_RANK", "WORLD_SIZE")},
              "runs": {}}
    extra = {"keep": [SYNC_ROLE]} if args.hsdp else {}  # the test's own gloo barriers
    plan = [("baseline", None), ("amem", {"backend": backend, **extra}),
            ("amem_overlap", {"backend": backend, "overlap": True, **extra}),
            ("baseline_again", None)]
    for name, options in plan:
        started = time.monotonic()
        result["runs"][name] = run(args, name, options)
        result["runs"][name]["wall_s"] = time.monotonic() - started
    lib = nccl_library()
    result["nccl"] = lib.version_str if lib else None
    result["device"] = None if SMOKE else torch.cuda.get_device_name()
    base = result["runs"]["baseline"]["median_step_s"]
    result["step_time_ratio"] = {n: result["runs"][n]["median_step_s"] / base
                                 for n in ("amem", "amem_overlap", "baseline_again")}
    result["checks"] = set_aside_on_cpu(checks_for(result, args), *MEMORY_CHECKS.get(
        "hsdp" if args.hsdp else "fsdp2" if args.fsdp2 else "ddp", ()))
    result.update(cpu_notes())
    result["goals"] = {"step_time_ratio_le_1.02": {n: r <= 1.02 for n, r in
                                                   result["step_time_ratio"].items()}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        summary = {"ok": all(all(r["checks"].values()) for r in everyone),
                   **provenance("tests/gpu/trl_gpu.py"), "ranks": everyone}
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1, default=str)
        for rank, r in enumerate(everyone):
            failed = [k for k, v in r["checks"].items() if not v]
            print(f"rank {rank}: step time ratio {r['step_time_ratio']}, failed checks: {failed}")
        print("OK" if summary["ok"] else "FAILED")


if __name__ == "__main__":
    main()
