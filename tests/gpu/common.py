"""Helpers shared by the real-NCCL scripts in this folder.

Every script runs N ranks on whatever GPUs exist: rank r uses GPU
``LOCAL_RANK % device_count`` (several ranks per GPU need NCCL >= 2.30 and
NCCL_MULTI_RANK_GPU_ENABLE=1, which tests/gpu/run_all.py sets). On a shared
GPU cudaMemGetInfo sees every rank, so memory checks compare the GPU's freed
bytes, read between barriers, with the NCCL bytes of all ranks on it.
"""

from __future__ import annotations

import os


def bind_device() -> int:
    """Make this rank's GPU current; returns its index."""
    import torch

    from amem_callbacks.tools.launch import local_device

    device = local_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def ranks_per_gpu() -> int:
    import torch
    import torch.distributed as dist

    return -(-dist.get_world_size() // torch.cuda.device_count())


def exact_allreduce(group, value: float, device="cuda", numel: int = 1 << 20) -> bool:
    """All-reduce ``value * (rank + 1)`` on ``group`` and check the exact sum:
    a wrong or partial result from a half-resumed communicator shows here."""
    import torch
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    t = torch.full((numel,), value * (dist.get_rank() + 1), device=device)
    dist.all_reduce(t, group=group)
    return bool(torch.all(t == value * sum(r + 1 for r in ranks)).item())


def free_bytes() -> int:
    """Free device memory after the queued work has finished."""
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def synced_free_bytes(sync) -> int:
    """Free device memory once every rank got here (``sync``: a gloo group)."""
    import torch.distributed as dist

    import torch

    torch.cuda.synchronize()
    dist.barrier(group=sync)
    return torch.cuda.mem_get_info()[0]


def same_gpu_total(sync, value: int) -> int:
    """Sum of ``value`` over the ranks on this rank's GPU (one GPU: all ranks)."""
    import torch
    import torch.distributed as dist

    from amem_callbacks.placement import device_id

    mine = device_id(torch.cuda.current_device())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, value), group=sync)
    return sum(v for dev, v in everyone if dev == mine)
