"""The first suspend on a freshly started host, against the package's default timeouts.

Measured once in Megatron's loop: on a machine just started, the first suspend
of 4.5 GiB per rank took 16.4 s instead of the 2.6-3.2 s of a warm one. NCCL
copies every suspended byte into pinned host memory it allocates on each
suspend (cudaHostAlloc), and on a new host (a VM whose memory the hypervisor
maps on first touch) that memory is slow the first time. This script is the
measurement: run it FIRST on a fresh machine, before anything else has touched
the host's memory. Each rank makes ``--groups`` communicators over every rank
with NCCL's default buffers (about 1.2 GB each for 2 ranks on one H200), then
runs ``--cycles`` begin/end cycles with the package's defaults (no timeout set:
agreement 120 s, each transition bounded by its group's c10d timeout), timing
each begin until its suspends finished and each end until its resumes did.

GPU (torchrun-style; several ranks on one GPU need NCCL >= 2.30):
    NCCL_MULTI_RANK_GPU_ENABLE=1 LD_PRELOAD=/path/libnccl.so.2 \\
        python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/cold_host_gpu.py OUT/cold.json
CPU check of the script (gloo, the fake NCCL): AMEM_GPU_DRIVER_ON_CPU=1, as
tests/test_gpu_drivers_on_cpu.py runs it.

Verdicts: every cycle suspends and resumes every group (none failed, none kept
for a timeout), every group is exact after each end, and the first begin stays
below every default timeout it runs under (``margin`` says by how much).
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu import common  # noqa: E402


def host_memory() -> dict:
    """MemTotal, MemFree, MemAvailable, Cached of /proc/meminfo, bytes."""
    return common.proc_fields("/proc/meminfo", ("MemTotal", "MemFree", "MemAvailable", "Cached"))


def uptime_s() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def timed_cycle(policy, sync, groups: dict, value: float) -> dict:
    """One begin/end; the begin until its suspends finished, the end until its resumes."""
    import torch.distributed as dist

    from amem_callbacks.group_book import group_timeout_s

    memory_before = host_memory()
    start = time.monotonic()
    begin = policy.begin("rollout")
    policy.wait()
    suspend_s = time.monotonic() - start
    memory_during = host_memory()
    dist.barrier(group=sync)  # the rollout: over gloo only while NCCL groups sleep
    start = time.monotonic()
    end = policy.end("rollout")
    policy.wait()
    resume_s = time.monotonic() - start
    exact = all(common.exact_allreduce(g, value) for g in groups.values())
    suspended = {g.name: g.suspendable_bytes for g in begin.suspended}
    return {
        "suspend_s": round(suspend_s, 3), "resume_s": round(resume_s, 3),
        "begin_wall_seconds": round(begin.wall_seconds, 3),
        "end_wall_seconds": round(end.wall_seconds, 3),
        "suspended": suspended, "suspended_bytes": sum(b or 0 for b in suspended.values()),
        "failed": [(g.name, g.error or g.reason) for g in begin.failed + end.failed],
        "kept": {g.name: g.reason for g in begin.kept},
        "exact_after_end": exact,
        "group_timeout_s": min(group_timeout_s(g) for g in groups.values()),
        "host_memory_before": memory_before, "host_memory_during": memory_during,
    }


def main(out_path: str, n_groups: int, cycles: int) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from amem_callbacks import OffloadPolicy, name_group

    booted_s = uptime_s()
    common.bind_device()
    dist.init_process_group(common.process_group_backend(), timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = common.gloo_group()
    groups = {}
    for i in range(n_groups):  # every rank makes every group, in the same order
        group = dist.new_group(list(range(world)))
        name_group(group, f"dp_{i}")
        groups[f"dp_{i}"] = group
    made = all(common.exact_allreduce(g, 1.0) for g in groups.values())  # communicators up
    policy = OffloadPolicy(backend=common.policy_backend(), groups=list(groups.values()),
                           device=common.policy_device(), min_bytes=0)  # default timeouts
    rows = [timed_cycle(policy, sync, groups, 2.0 + c) for c in range(cycles)]
    policy.close()

    first, warm = rows[0], rows[1:]
    gib = first["suspended_bytes"] / 2**30
    defaults = {"agree_timeout_s": policy.options.agree_timeout_s,
                "timeout_s": policy.options.timeout_s,
                "transition_bound_s (the group's c10d timeout)": first["group_timeout_s"]}
    bound = min(policy.options.agree_timeout_s, first["group_timeout_s"])
    checks = {
        "communicators_made_exact": made,
        "every_cycle_suspended_every_group": all(len(r["suspended"]) == n_groups for r in rows),
        "no_group_failed": not any(r["failed"] for r in rows),
        "no_group_kept_for_a_timeout": not any("did not" in why for r in rows
                                               for why in r["kept"].values()),
        "exact_after_every_end": all(r["exact_after_end"] for r in rows),
        "first_suspend_below_every_default_timeout": first["suspend_s"] < bound,
    }
    checks = common.set_aside_on_cpu(checks, "first_suspend_below_every_default_timeout")
    record = {"rank": rank, "checks": checks, "cycles": rows,
              "first_suspend_s": first["suspend_s"],
              "warm_suspend_s": [r["suspend_s"] for r in warm],
              "first_over_warm": (round(first["suspend_s"] / min(r["suspend_s"] for r in warm), 2)
                                  if warm else None),
              "first_suspend_s_per_gib": round(first["suspend_s"] / gib, 3) if gib else None,
              "suspended_gib": round(gib, 3), "defaults": defaults,
              "margin_s": round(bound - first["suspend_s"], 1),
              "host_uptime_at_start_s": booted_s}
    records = [None] * world
    dist.all_gather_object(records, record, group=sync)
    if rank == 0:
        summary = {
            "question": "Does the first suspend on a freshly started host trip a default "
                        "timeout of the package, and how slow is it?",
            "ok": all(v is not False for r in records for v in r["checks"].values()),
            "command": " ".join([f"NCCL_MULTI_RANK_GPU_ENABLE={os.environ.get('NCCL_MULTI_RANK_GPU_ENABLE', '')}",
                                 f"{os.path.basename(sys.executable)} -m torch.distributed.run", f"--nproc-per-node {world}",
                                 "tests/gpu/cold_host_gpu.py", *sys.argv[1:]]),
            "commit": common.run_commit(),
            "mode": "cpu-fake-nccl" if common.ON_CPU else "gpu",
            "torch": torch.__version__, "ranks": world, "groups_per_rank": n_groups,
            "gpu": None if common.ON_CPU else torch.cuda.get_device_name(),
            "ranks_per_gpu": common.ranks_per_gpu(), "cpu_notes": common.cpu_notes(),
            "ranks_records": records,
        }
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"cold_host: ok={summary['ok']} first suspend "
              f"{[r['first_suspend_s'] for r in records]} s for "
              f"{[r['suspended_gib'] for r in records]} GiB, warm "
              f"{[r['warm_suspend_s'] for r in records]} s", flush=True)
    dist.barrier(group=sync)
    dist.destroy_process_group()
    return 0 if all(v is not False for v in record["checks"].values()) else 1


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the result JSON (rank 0 writes it)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    sys.exit(main(args.out, args.groups, args.cycles))
