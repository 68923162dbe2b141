"""The rank side of ``amem-callbacks demo``: one rank's train/rollout loop (what
the demo shows is described in demo.py).

torch is imported at the top: this module is imported only in the rank
processes and by ``demo.main`` once ``quiet_missing_numpy()`` ran.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..groups import name_group
from ..policy import OffloadPolicy
from .demo_report import print_table, summary, write_json
from .launch import free_port, gather_ints, local_device


def worker(rank: int, world: int, port: int, steps: int, rollout_s: float, backend: str,
            use_cuda: bool, out: str) -> None:
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
        print_table(rows, policy)
        path = write_json(out, rows, policy, world)
        print(summary(rows, policy, path))
    dist.barrier(group=sync)
    dist.destroy_process_group()


def _gpu_free(sync, use_cuda: bool):
    """cudaMemGetInfo once every rank got here: on a shared GPU it sees every rank."""
    if not use_cuda:
        return None
    torch.cuda.synchronize()
    dist.barrier(group=sync)
    return torch.cuda.mem_get_info()[0]


def spawn(world: int, steps: int, rollout_s: float, backend: str, use_cuda: bool,
          out: str) -> None:
    """``world`` rank processes of :func:`worker` (spawned, never forked: CUDA does
    not survive a fork)."""
    mp.start_processes(worker, args=(world, free_port(), steps, rollout_s, backend, use_cuda,
                                     out), nprocs=world, start_method="spawn")
