"""``amem-callbacks demo``: a small RL-shaped loop (train, then rollout) on every
local GPU with real NCCL suspend, or on 2 CPU processes as a dry run.

Each step trains a tiny model with a gradient all-reduce on the data-parallel
group, then enters rollout: the policy suspends the groups rollout does not use
(keeping "tp"), the rollout computes, and the policy resumes them.
"""

from __future__ import annotations

import os
import socket
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, steps: int, rollout_s: float, backend: str,
            use_cuda: bool) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from amem_callbacks import OffloadPolicy, name_group

    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(message)s")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    groups = {}
    for role in ("dp", "tp", "ep"):
        groups[role] = dist.new_group(list(range(world)))
        name_group(groups[role], role)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    policy = OffloadPolicy(backend=backend, keep=["tp"])
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
        begin = policy.begin("rollout")
        t0 = time.monotonic()
        a = torch.randn(1024, 1024, device=device)
        while time.monotonic() - t0 < rollout_s:  # "generation": compute only
            a = torch.tanh(a @ a / 32)
        dist.all_reduce(a[:1, :1], group=groups["tp"])  # the kept group still works
        end = policy.end("rollout")
        rows.append((step, loss.item(), begin, end))
    if rank == 0:
        _print_table(rows, policy)
    dist.barrier()
    dist.destroy_process_group()


def _print_table(rows, policy) -> None:
    mib = 2**20
    print(f"\nbackend: {policy.backend.name if policy.backend else 'none'}"
          f"{' (inert: ' + policy.backend_description + ')' if policy.inert else ''}")
    print(f"{'step':>4}  {'loss':>8}  {'suspended / would':<28}  {'NCCL MiB':>8}  "
          f"{'freed MiB':>9}  {'begin s':>7}  {'end s':>6}")
    for step, loss, begin, end in rows:
        moved = [g.name for g in begin.groups if g.action in ("suspended", "would suspend")]
        freed = begin.device_freed_bytes
        print(f"{step:>4}  {loss:>8.4f}  {','.join(moved) or begin.skipped or '-':<28}  "
              f"{begin.nccl_bytes / mib:>8.0f}  {(freed / mib if freed is not None else 0):>9.0f}  "
              f"{begin.wall_seconds:>7.3f}  {end.wall_seconds:>6.3f}")
    kept = {g.name: g.reason for g in rows[-1][2].kept}
    if kept:
        print("kept active: " + "; ".join(f"{k} ({v})" for k, v in kept.items()))
    print(f"totals: {policy.counters.as_dict()}")


def main(steps: int = 5, rollout_s: float = 0.5, backend: str = None) -> int:
    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    use_cuda = gpus >= 2
    world = gpus if use_cuda else 2
    backend = backend or ("auto" if use_cuda else "noop")
    where = f"{world} GPUs, NCCL" if use_cuda else "2 CPU processes, gloo (dry run: no GPU here)"
    print(f"amem-callbacks demo: {where}, backend {backend!r}, {steps} steps")
    mp.start_processes(_worker, args=(world, _free_port(), steps, rollout_s, backend, use_cuda),
                       nprocs=world, start_method="spawn")
    return 0
