"""Simulated nodes on one host: every rank (or every pair of ranks) claims its own
host through NCCL_HOSTID, so NCCL connects ranks of different "nodes" over its
socket transport (NET/Socket on lo), as it would across machines.

Layout: 8 ranks as TP=2 x PP=2 x DP=2 (Megatron's order: tp fastest, then dp,
then pp), world included. With one "node" per rank (--ranks-per-node 1, the
default) every group, tp too, crosses nodes: this exercises suspend, resume
and the guard over the network transport, per-group transport reporting, and
what stays allocated (socket buffers live in host memory; NCCL counts little
suspendable GPU memory there). With --ranks-per-node 2, each tp pair shares
a node (intra-node transport) while dp, pp and world cross nodes, as in a
Megatron job with TP inside a node. Several ranks share each GPU here
(NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1): only the behaviour counts,
not the memory or time figures.

Cases, each checked for exact collectives afterwards and bounded in time:
overlap off; overlap on with 4 workers; a guard resume of a dp group during the
phase; a disagreeing keep-set (rank 0 keeps "dp", the others do not).

Command (the driver starts the ranks itself):
    python tests/gpu/multinode_gpu.py OUT.json [--ranks 8] [--ranks-per-node 1]
CPU check of this script (gloo and the fake NCCL, tests/gpu/common.py; NCCL_HOSTID
still makes the package see one host per rank, so transports read "network"):
    AMEM_GPU_DRIVER_ON_CPU=1 python tests/gpu/multinode_gpu.py /tmp/multinode.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script: tests.gpu.common from the repo
    sys.path.insert(0, ROOT)
TP, PP = 2, 2


def layout(world: int) -> dict:
    """Role -> list of rank lists (Megatron order: tp fastest, then dp, then pp)."""
    dp = world // (TP * PP)
    rank_of = lambda t, d, p: t + TP * (d + dp * p)  # noqa: E731
    return {
        "tp": [[rank_of(t, d, p) for t in range(TP)] for p in range(PP) for d in range(dp)],
        "dp": [[rank_of(t, d, p) for d in range(dp)] for p in range(PP) for t in range(TP)],
        "pp": [[rank_of(t, d, p) for p in range(PP)] for d in range(dp) for t in range(TP)],
    }


def rank_main(out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from amem_callbacks import OffloadPolicy, name_group
    from tests.gpu.common import bind_device, cpu_notes, exact_allreduce, gloo_group, \
        policy_backend, policy_device, process_group_backend

    bind_device()
    dist.init_process_group(process_group_backend("nccl"), timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = gloo_group()
    mine = {}
    for role, rank_lists in layout(world).items():
        for ranks in rank_lists:  # every rank creates every group, as new_group requires
            group = dist.new_group(ranks, timeout=timedelta(seconds=120))
            if rank in ranks:
                mine[role] = group
                name_group(group, role)
    groups = {"world": dist.group.WORLD, **mine}
    for group in groups.values():
        assert exact_allreduce(group, 1.0, numel=1 << 16)
    result = {"rank": rank, "host": os.environ.get("NCCL_HOSTID"), "cases": {}, **cpu_notes()}

    def run_case(name, keep, **options):
        policy = OffloadPolicy(backend=policy_backend("nccl"), keep=keep, min_bytes=0,
                               agree_timeout_s=60, device=policy_device(), **options)
        dist.barrier(group=sync)
        start = time.monotonic()
        begin = policy.begin("rollout")
        policy.wait()
        row = {"groups": {g.name: {"action": g.action, "reason": g.reason,
                                   "transport": g.transport,
                                   "suspendable": g.suspendable_bytes,
                                   "persistent": g.persist_bytes, "stays": g.stays_bytes,
                                   "stays_why": g.stays_why} for g in begin.groups}}
        row["kept_tp_works"] = exact_allreduce(groups["tp"], 2.0, numel=1 << 16) \
            if "tp" in keep else None
        if name == "guard_resume":  # a collective on a suspended dp group, mid-phase
            row["guard_resume_exact"] = exact_allreduce(groups["dp"], 3.0, numel=1 << 16)
            row["auto_resumes"] = policy.metrics(last=False)["amem/total/auto_resumes"]
        dist.barrier(group=sync)
        end = policy.end("rollout")
        policy.wait()
        row["resumed"] = sorted(g.name for g in end.groups if g.action == "resumed")
        row["exact_after"] = all(exact_allreduce(g, 4.0, numel=1 << 16) for g in groups.values())
        row["seconds"] = time.monotonic() - start
        result["cases"][name] = row

    run_case("overlap_off", ["tp"])
    run_case("overlap_on_4_workers", ["tp"], overlap=True, workers=4)
    run_case("guard_resume", ["tp"])
    run_case("disagreeing_keep", ["tp", "dp"] if rank == 0 else ["tp"])
    dist.barrier(group=sync)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    dist.barrier(group=sync)
    dist.destroy_process_group()


def check(ranks: list, world: int) -> dict:
    """What must hold, from every rank's result."""
    dp_of_rank0 = next(g for g in layout(world)["dp"] if 0 in g)
    checks = {"every_rank_reported": len(ranks) == world}
    if len(ranks) != world:
        return checks
    for name in ("overlap_off", "overlap_on_4_workers", "guard_resume", "disagreeing_keep"):
        rows = [r["cases"][name] for r in ranks]
        checks[f"{name}_exact"] = all(row["exact_after"] for row in rows)
        checks[f"{name}_kept_tp_works"] = all(row["kept_tp_works"] for row in rows)
        checks[f"{name}_suspended_something"] = all(
            any(g["action"] == "suspended" for g in row["groups"].values()) for row in rows)
    guard = [r["cases"]["guard_resume"] for r in ranks]
    checks["guard_resume_exact"] = all(row["guard_resume_exact"] for row in guard)
    checks["guard_resumed_dp"] = all(row["auto_resumes"] == 1 for row in guard)
    for r in ranks:
        dp = r["cases"]["disagreeing_keep"]["groups"]["dp"]["action"]
        want = "kept" if r["rank"] in dp_of_rank0 else "suspended"
        checks[f"disagreeing_keep_rank{r['rank']}_dp_{want}"] = dp == want
    checks["transport_reported"] = all(
        g["transport"] for r in ranks for g in r["cases"]["overlap_off"]["groups"].values())
    return checks


def driver(out_path: str, world: int, per_node: int) -> int:
    from tests.gpu.common import provenance

    out_dir = tempfile.mkdtemp(prefix="amem-multinode-")
    from amem_callbacks.tools.launch import free_port
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   NCCL_HOSTID=f"node{rank // per_node}", NCCL_NET="Socket",
                   NCCL_SOCKET_IFNAME="lo", NCCL_MULTI_RANK_GPU_ENABLE="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank",
                                       out_dir], env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 540
    hung = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    ranks = []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            ranks.append(json.load(open(path)))
    checks = check(ranks, world) if not hung else {"no_hang": False}
    checks["no_hang"] = not hung
    summary = {
        **provenance("tests/gpu/multinode_gpu.py"),  # the driver's command: it starts the ranks
        "nodes": -(-world // per_node), "ranks_per_node": per_node, "world": world,
        "layout": layout(world), "ok": all(checks.values()), "checks": checks,
        "exit_codes": [p.returncode for p in procs], "ranks": ranks,
        "log_tails": {r: open(os.path.join(out_dir, f"rank{r}.log")).read()[-2000:]
                      for r in range(world)} if not all(checks.values()) else {}}
    with open(out_path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(("OK" if summary["ok"] else "FAILED") + " " + json.dumps(checks), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(sys.argv[2])
    else:
        import argparse

        from amem_callbacks.tools.cli import ranks  # the same rule as the amem-callbacks tools

        parser = argparse.ArgumentParser()
        parser.add_argument("out")
        parser.add_argument("--ranks", type=ranks, default=8)
        parser.add_argument("--ranks-per-node", type=int, default=1)
        a = parser.parse_args()
        sys.exit(driver(a.out, a.ranks, a.ranks_per_node))
