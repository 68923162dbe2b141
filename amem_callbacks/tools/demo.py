"""``amem-callbacks demo``: a small RL-shaped loop (train, then rollout) on the
local GPUs with real NCCL suspend (several ranks per GPU where NCCL allows it,
so one GPU is enough), or on 2 CPU processes as a dry run.

Each step trains a tiny model with a gradient all-reduce on the data-parallel
group, then enters rollout: the policy suspends the groups rollout does not use
(keeping "tp"), the rollout computes, and the policy resumes them.
"""

from __future__ import annotations

import os
import tempfile
import time
from .launch import free_port


def _worker(rank: int, world: int, port: int, steps: int, rollout_s: float, backend: str,
            use_cuda: bool, out: str) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from amem_callbacks import OffloadPolicy, name_group
    from amem_callbacks.tools.launch import gather_ints, local_device

    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(message)s")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", local_device(rank)) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    sync = dist.new_group(backend="gloo")  # lines ranks up while NCCL groups are suspended
    groups = {}
    for role in ("dp", "tp", "ep"):
        groups[role] = dist.new_group(list(range(world)))
        name_group(groups[role], role)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    policy = OffloadPolicy(backend=backend, keep=["tp"],  # not the gloo sync group
                           groups=[dist.group.WORLD, *groups.values()])
    rows = []
    for step in range(steps):
        x = torch.randn(64, 256, device=device, generator=None)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # data-parallel gradient average
            dist.all_reduce(p.grad, group=groups["dp"])
            p.grad /= world
        for g in [dist.group.WORLD, *groups.values()]:
            dist.all_reduce(torch.ones(1, device=device), group=g)  # every comm exists
        optimizer.step()
        free_before = _gpu_free(sync, use_cuda)
        begin = policy.begin("rollout")
        freed = _gpu_free(sync, use_cuda) - free_before if use_cuda else None
        nccl_all = [r[0] for r in gather_ints([begin.nccl_bytes], sync)]  # NCCL's own stats
        t0 = time.monotonic()
        a = torch.randn(1024, 1024, device=device)
        while time.monotonic() - t0 < rollout_s:  # "generation": compute only
            a = torch.tanh(a @ a / 32)
        dist.all_reduce(a[:1, :1], group=groups["tp"])  # the kept group still works
        end = policy.end("rollout")
        rows.append((step, loss.item(), begin, end, nccl_all, freed))
    if rank == 0:
        from .demo_report import print_table, summary, write_json

        print_table(rows, policy)
        path = write_json(out, rows, policy, world)
        print(summary(rows, policy, path))
    dist.barrier(group=sync)
    dist.destroy_process_group()


def _gpu_free(sync, use_cuda: bool):
    """cudaMemGetInfo once every rank got here: on a shared GPU it sees every rank."""
    import torch
    import torch.distributed as dist

    if not use_cuda:
        return None
    torch.cuda.synchronize()
    dist.barrier(group=sync)
    return torch.cuda.mem_get_info()[0]


def main(steps: int = 5, rollout_s: float = 0.5, backend: str = None,
         ranks: int = None, out: str = None) -> int:
    """``out``: the folder for demo.json (the CLI checked it is writable)."""
    import sys

    from .launch import backend_refusal, plan_ranks, quiet_missing_numpy

    quiet_missing_numpy()
    import torch.multiprocessing as mp

    layout = plan_ranks(ranks)
    if layout.refused:
        print(f"amem-callbacks demo: {layout.refused}")
        return 1
    refused = backend_refusal(backend, layout.on_gpu)
    if refused:  # before any rank starts: a demo of a backend that cannot run shows nothing
        print(f"amem-callbacks demo: {refused}", file=sys.stderr)
        return 1
    use_cuda = layout.on_gpu
    world = layout.ranks
    os.environ.update(layout.env)  # inherited by the rank processes
    backend = backend or ("auto" if use_cuda else "noop")
    where = layout.describe() if use_cuda else (
        f"{world} CPU processes, gloo (dry run: no GPU here)")
    print(f"amem-callbacks demo: {where}, backend {backend!r}, {steps} steps")
    out = out or tempfile.mkdtemp(prefix="amem-demo-")
    mp.start_processes(_worker, args=(world, free_port(), steps, rollout_s, backend, use_cuda,
                                      out), nprocs=world, start_method="spawn")
    return 0
