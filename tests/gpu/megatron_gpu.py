"""Megatron adapter on real NCCL: 2 ranks, real ``parallel_state`` groups, the
hooked ``DynamicInferenceEngine`` class of megatron-core 0.16.1.

Command (repo root, 2 GPUs, NCCL >= 2.29.7 loaded, e.g. LD_PRELOAD of
../shared/tools/device-nccl's output; carry the megatron-core wheel):
    pip install --no-deps megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
    pip install --no-deps --no-build-isolation -e .   # the GPU scripts run on the installed package
    python tests/gpu/megatron_gpu.py OUT_DIR

Three configurations, each under its own ``torch.distributed.run``:
    dp2       TP=1, DP=2, in-place inference (the kept groups have one rank)
    tp2       TP=2, DP=1, in-place inference (tp, mp, ... span both ranks and stay active)
    separate  TP=1, DP=2 training; inference on its own TP=2 groups (all training groups idle)
For each, 3 rollouts: ``engine.resume()`` must free >= 99 % of the NCCL
suspendable bytes of the groups it suspended (cudaMemGetInfo), NCCL's stats
must say suspended for exactly those, the kept groups must run exact
all-reduces meanwhile, and after ``engine.suspend()`` every group is active
again with exact results. Workers run through the package's launcher,
``python -m amem_callbacks.adapters.megatron ... --rl-amem-offload-during-rollout
--rl-amem-backend nccl`` (a bare tree stops with the install command).
Writes OUT_DIR/megatron_gpu.json (and per-rank files); exit 0 when every check passes.
One configuration alone:
    python -m torch.distributed.run --nproc-per-node 2 tests/gpu/megatron_gpu.py --worker tp2 OUT_DIR
Some of them through the driver: ``tests/gpu/megatron_gpu.py OUT_DIR --configs dp2,tp2``.
CPU check of this script (gloo and the fake NCCL, tests/gpu/common.py; the
launcher's settings, with the fake NCCL behind them; memory checks not judged):
    AMEM_GPU_DRIVER_ON_CPU=1 python tests/gpu/megatron_gpu.py /tmp/megatron --configs separate

Ranks synchronise over a gloo group while NCCL groups are suspended.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script: tests.gpu.common from the repo
    sys.path.insert(0, ROOT)
CONFIGS = ("dp2", "tp2", "separate")
FLAGS = ["--rl-amem-offload-during-rollout", "--rl-amem-backend", "nccl"]
MiB = 2**20


def import_adapter():
    """The adapter, from the installed package (a bare tree stops with the install
    command: common.require_installed_package)."""
    from tests.gpu.common import require_installed_package

    require_installed_package()
    import amem_callbacks.adapters.megatron as adapter

    return adapter


# --- worker (one rank) ----------------------------------------------------
def nccl_suspended(entries) -> dict:
    """NCCL's own word per group (ncclCommMemStats), read past the policy's
    bookkeeping: through a backend of this script's own over the NCCL this process
    loaded (the fake's on CPU), for groups the policy holds and those it does not."""
    from amem_callbacks.backends.nccl import NcclBackend
    from tests.gpu.common import comm_handle, nccl_library

    reader = NcclBackend(library=nccl_library())
    out = {}
    for entry in entries:
        handle, _ = comm_handle(entry.group)
        out[entry.name] = None if handle is None else reader.memory(handle).suspended
    return out


def backend_record(controller) -> dict:
    """The backend as the last begin report names it; when every begin did nothing
    (inert: none is in the session's history), wait() gives the last report, which
    says why; and the NCCL this process loaded, which the nccl backend calls."""
    from tests.gpu.common import nccl_library

    inert = bool(controller.policy.metrics()["amem/inert"])
    report = controller.last_begin or controller.policy.wait()
    lib = nccl_library()
    return {"name": getattr(report, "backend", None), "inert": inert,
            "why_inert": report.skipped if inert and report is not None else None,
            "nccl": None if lib is None else f"NCCL {lib.version_str} from {lib.path}"}


def worker(config: str, out_dir: str) -> bool:
    import torch
    import torch.distributed as dist

    adapter = import_adapter()
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from tests.gpu.common import ON_CPU, bind_device, cpu_notes, exact_allreduce as exact, \
        free_bytes, gloo_group, process_group_backend, provenance, set_aside_on_cpu, \
        stand_in_backend
    from tests.gpu.megatron_engine import make_engine

    bind_device()  # LOCAL_RANK % GPUs: several ranks may share one
    dist.init_process_group(process_group_backend("nccl"))
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = gloo_group()
    ps.initialize_model_parallel(tensor_model_parallel_size=2 if config == "tp2" else 1)
    # training has run collectives on these groups: their communicators exist
    created = all(exact(e.group, 1.0) for e in adapter.roles.parallel_state_groups(ps))
    if config == "separate":
        inference_tp = dist.new_group(list(range(world)))
        singles = [dist.new_group([r]) for r in range(world)]
        collection = ProcessGroupCollection(tp=inference_tp, pp=singles[rank], mp=inference_tp)
        created &= exact(inference_tp, 1.0) and exact(singles[rank], 1.0)
    else:
        collection = ProcessGroupCollection.use_mpu_process_groups()

    controller = adapter.hooks.current_controller()  # from the launcher's flags
    via_launcher = controller is not None
    if controller is None or ON_CPU:  # CPU: the launcher's settings over the fake NCCL
        settings = controller.settings if controller is not None else \
            adapter.Settings(enabled=True, backend="nccl")
        controller = adapter.install(settings=settings, backend=stand_in_backend())
    engine = make_engine(collection)  # tests/gpu/megatron_engine.py
    total = torch.cuda.mem_get_info()[1]
    checks = {"communicators_created_exact": created}
    cycles = []
    for cycle in range(3):
        free0 = free_bytes()
        engine.resume()
        controller.policy.wait()  # the adapter's begin overlaps: its suspends run behind it
        free1 = free_bytes()
        via_begin, begin = controller.reports[-1]
        plan = controller.rollout_groups
        kept = [e for e in plan.entries if e.keep]
        idle = [e.name for e in plan.entries if not e.keep]
        suspended = {g.name: g.suspendable_bytes or 0 for g in begin.suspended}
        nccl_bytes = sum(suspended.values())
        stats_during = nccl_suspended(plan.entries)
        kept_exact = {e.name: exact(e.group, cycle + 2.0) for e in kept}
        dist.barrier(group=sync)
        engine.suspend()
        controller.policy.wait()  # and so does its end
        free2 = free_bytes()
        via_end, end = controller.reports[-1]
        stats_after = nccl_suspended(plan.entries)
        all_exact = all(exact(e.group, cycle + 3.0) for e in plan.entries)
        c = {
            "via": [via_begin, via_end], "mode": plan.mode, "kept": [e.name for e in kept],
            "idle": idle, "suspended": suspended,
            "idle_left_active": {g.name: g.reason for g in begin.groups
                                 if g.name in idle and g.action != "suspended"},
            "nccl_suspendable_bytes": nccl_bytes, "device_freed": free1 - free0,
            "device_freed_by_policy": begin.device_freed_bytes,
            "device_back_after_end": free2 - free0,
            "freed_pct": 100.0 * (free1 - free0) / nccl_bytes if nccl_bytes else None,
            "begin_wall_s": begin.wall_seconds, "end_wall_s": end.wall_seconds,
            "stats_during": stats_during, "stats_after": stats_after, "kept_exact": kept_exact,
            "checks": {
                "hooks_fired_on_engine": [via_begin, via_end] == [
                    "DynamicInferenceEngine.resume", "DynamicInferenceEngine.suspend"],
                "world_suspended": "world" in suspended,
                "only_idle_suspended": set(suspended) <= set(idle),
                "freed_ge_99pct_of_suspendable": (free1 - free0) >= 0.99 * nccl_bytes > 0,
                "nccl_says_suspended_exactly_those": {
                    n for n, s in stats_during.items() if s} == set(suspended),
                "kept_groups_exact_during": all(kept_exact.values()),
                "all_active_after_end": not any(stats_after.values()),
                "exact_after_end": all_exact,
                "memory_back_after_end": abs(free2 - free0) <= 64 * MiB,
            }}
        if config == "separate":
            c["checks"]["every_training_group_idle"] = bool(kept) and all(
                e.name.startswith("inference_") for e in kept)
        set_aside_on_cpu(c["checks"], "freed_ge_99pct_of_suspendable", "memory_back_after_end")
        cycles.append(c)
    if config == "tp2":
        checks["a_kept_group_spans_both_ranks"] = any(
            len(dist.get_process_group_ranks(e.group)) == 2 for e in kept)
    ok = all(checks.values()) and all(all(c["checks"].values()) for c in cycles)
    result = {"config": config, "rank": rank, "ok": ok, "via_launcher": via_launcher,
              "checks": checks, "cycles": cycles, "device_total": total,
              "counters": controller.policy.metrics(last=False),
              "nccl_backend": backend_record(controller),
              "torch": torch.__version__,
              **cpu_notes(), **provenance("tests/gpu/megatron_gpu.py")}
    with open(os.path.join(out_dir, f"megatron_gpu.{config}.rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    dist.barrier(group=sync)
    dist.destroy_process_group()
    print(f"[{config} rank {rank}] {'OK' if ok else 'FAILED'} freed "
          f"{[round(c['freed_pct'] or 0, 2) for c in cycles]} % of suspendable; "
          f"suspended {sorted(cycles[0]['suspended'])}", flush=True)
    return ok


# --- driver ------------------------------------------------------------------
def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--worker"]:
        config, out_dir = args[1], args[2]
        return 0 if worker(config, out_dir) else 1
    configs = CONFIGS
    if "--configs" in args:
        at = args.index("--configs")
        configs = tuple(args[at + 1].split(","))
        del args[at:at + 2]
        unknown = sorted(set(configs) - set(CONFIGS))
        if unknown:
            raise SystemExit(f"unknown configuration(s) {unknown}: choose from {CONFIGS}")
    out_dir = args[0] if args else os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    from tests.gpu.common import provenance, require_installed_package

    require_installed_package()  # the package's launcher runs every configuration
    summary = {"launcher": True, "configs": {}, **provenance("tests/gpu/megatron_gpu.py")}
    for config in configs:
        target = ["-m", "amem_callbacks.adapters.megatron", os.path.abspath(__file__),
                  "--worker", config, out_dir, *FLAGS]
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                               "2", *target], cwd=ROOT, env=env, timeout=600)
        ranks = []
        for rank in range(2):
            path = os.path.join(out_dir, f"megatron_gpu.{config}.rank{rank}.json")
            ranks.append(json.load(open(path)) if os.path.exists(path) else {"ok": False})
        summary["configs"][config] = {
            "returncode": proc.returncode, "ok": proc.returncode == 0 and all(
                r.get("ok") for r in ranks),
            "freed_pct": [c["freed_pct"] for c in ranks[0].get("cycles", [])],
            "suspended": ranks[0]["cycles"][0]["suspended"] if ranks[0].get("cycles") else None,
            "kept": ranks[0]["cycles"][0]["kept"] if ranks[0].get("cycles") else None,
            "failed_checks": sorted({k for r in ranks for c in r.get("cycles", [])
                                     for k, v in c["checks"].items() if not v}
                                    | {k for r in ranks for k, v in r.get("checks", {}).items()
                                       if not v})}
    summary["ok"] = all(c["ok"] for c in summary["configs"].values())
    with open(os.path.join(out_dir, "megatron_gpu.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
