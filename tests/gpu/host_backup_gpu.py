"""Keeping NCCL's host backup on real NCCL (amem_callbacks/host_backup.py): a soak of
begin/end cycles at NCCL's default buffer sizes, every resume checked exact, the
memory read as it goes; or fewer cycles with the backup re-pinned (``--reuse off``),
for the same figures NCCL gives as it is.

GPU (NCCL >= 2.30 preloaded; several ranks on one GPU):
    PYTHONPATH=. LD_PRELOAD=/tmp/nccl/libnccl.so.2 NCCL_MULTI_RANK_GPU_ENABLE=1 \\
      python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/host_backup_gpu.py \\
      OUT.json [--cycles 1000] [--groups 1] [--reuse on|off]
CPU check of this script (gloo, the fake NCCL's runtime build and its stand-in driver):
    AMEM_GPU_DRIVER_ON_CPU=1 python3 -m torch.distributed.run --nproc-per-node 2 \\
      tests/gpu/host_backup_gpu.py /tmp/hb.json --cycles 20

Each rank writes OUT.json with ``.rank<r>`` before the suffix: per cycle the suspend
and resume seconds, about a hundred times in the run host RSS, free device memory, the hook's kept
and newly pinned bytes; the verdicts: no failure, every all-reduce exact, no new
pinning after the first cycle (reuse on), RSS, free memory and kept bytes flat.
While the groups are suspended the ranks meet over a gloo group only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.gpu import common  # noqa: E402

#: the CPU mode's backup: entries and bytes per communicator
CPU_BACKUP = (6, 256 << 10)


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def flat(values: list, tolerance: float) -> dict:
    """After the first tenth (warm-up): the last tenth's median within ``tolerance``
    (relative) of the first tenth's after warm-up."""
    import statistics

    xs = [v for v in values if v is not None]
    if len(xs) < 10:  # a short run (a smoke test) is not judged flat or not
        return {"ok": None, "why": f"{len(xs)} readings; 10 needed to judge"}
    post = xs[max(1, len(xs) // 10):]
    window = max(1, len(post) // 10)
    first, last = statistics.median(post[:window]), statistics.median(post[-window:])
    ok = abs(last - first) <= tolerance * max(abs(first), 1)
    return {"ok": ok, "first": first, "last": last}


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    from amem_callbacks import OffloadPolicy, host_backup

    if common.ON_CPU:
        common.fake_nccl(default_mib=64, backup=CPU_BACKUP)  # its runtime: this build
    hook = host_backup.install((common.nccl_library().path if common.ON_CPU else None))
    device = common.bind_device()
    dist.init_process_group(common.process_group_backend())
    sync = common.gloo_group()
    groups = [dist.new_group(list(range(dist.get_world_size()))) for _ in range(args.groups)]
    for g in groups:  # creates each communicator (the runtime started with the first)
        common.exact_allreduce(g, 1.0, numel=1024)
    policy = OffloadPolicy(backend=common.policy_backend(), groups=groups, workers=4,
                           device=common.policy_device(), reuse_host_backup=args.reuse == "on",
                           timeout_s=300)
    cycles, readings, failures = [], [], []
    every = max(1, args.cycles // 100)  # about 100 readings, however long the run
    start = time.monotonic()
    for cycle in range(args.cycles):
        try:
            dist.barrier(group=sync)
            begin = policy.begin("rollout")
            dist.barrier(group=sync)
            end = policy.end("rollout")
            exact = all(common.exact_allreduce(g, float(cycle % 7 + 1)) for g in groups)
        except Exception as exc:  # a failure is a finding, not the end of the record
            failures.append({"cycle": cycle, "error": repr(exc)})
            break
        stats = host_backup.stats()
        cycles.append({"suspend_s": round(begin.wall_seconds, 4),
                       "resume_s": round(end.wall_seconds, 4), "bytes": begin.nccl_bytes,
                       "exact": exact, "pinned_new": stats.get("pinned_new"),
                       "reused": stats.get("reused")})
        if cycle % every == 0 or cycle == args.cycles - 1:
            readings.append({"cycle": cycle, "rss": rss_bytes(), "free": common.free_bytes(),
                             "kept_bytes": stats.get("kept_bytes"),
                             "pinned_new_bytes": stats.get("pinned_new_bytes")})
    wall = time.monotonic() - start
    policy.close()
    after_close = host_backup.stats()
    new_pins = [c["pinned_new"] for c in cycles]
    checks = {
        "no_failure": not failures,
        "every_resume_exact": bool(cycles) and all(c["exact"] for c in cycles),
        "every_cycle_suspended": bool(cycles) and all(c["bytes"] for c in cycles),
        "hook_active": host_backup.active() if args.reuse == "on" else None,
        "no_new_pinning_after_first_cycle": (len(set(new_pins[1:])) <= 1
                                             if args.reuse == "on" and cycles else None),
        "host_rss_flat": flat([r["rss"] for r in readings], 0.01)["ok"],
        "device_free_flat": flat([r["free"] for r in readings], 0.01)["ok"],
        "kept_bytes_flat": flat([r["kept_bytes"] for r in readings], 0.0)["ok"]
        if args.reuse == "on" else None,
        "nothing_kept_after_close": after_close.get("kept_bytes", 0) == 0,
    }
    common.set_aside_on_cpu(checks, "device_free_flat", "host_rss_flat")
    return {"command": " ".join(sys.argv), "commit": common.commit(),
            "machine": common.machine(), "rank": dist.get_rank(),
            "world": dist.get_world_size(), "groups": args.groups, "reuse": args.reuse,
            "hook": hook.__dict__, "why_inactive": host_backup.why_inactive(),
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "wall_s": wall, "checks": checks, "ok": all(v for v in checks.values()
                                                         if v is not None),
            "failures": failures, "cycles": cycles, "readings": readings,
            "after_close": after_close, **common.cpu_notes()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--reuse", choices=("on", "off"), default="on")
    args = parser.parse_args()
    result = run(args)
    stem, suffix = os.path.splitext(args.out)
    with open(f"{stem}.rank{result['rank']}{suffix}", "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"rank": result["rank"], "ok": result["ok"], "checks": result["checks"],
                      "wall_s": round(result["wall_s"], 1)}), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
