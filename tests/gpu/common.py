"""Helpers shared by the real-NCCL scripts in this folder."""

from __future__ import annotations


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
