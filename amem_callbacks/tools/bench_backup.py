"""The bench's host-backup stage (P6; torch at the top: it runs only in the rank
processes, imported by bench_rank): what one suspend + resume cycle costs per GiB
with NCCL's host backup kept between cycles against re-pinned every time, in one
run on the same groups, beside the floor: copying the same bytes out and back.

Blocks of cycles alternate, reuse off then on, twice: a block's first cycle is its
warm-up (the run's first pays NCCL's first allocations; an "on" block's first
re-pins what the "off" block before it unpinned) and is reported apart.
"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch

from .. import host_backup
from ..policy import OffloadPolicy

GIB = 2**30


def _cycle(loop, policy) -> dict:
    """One begin and end, each timed between barriers of the gloo group."""
    before = host_backup.stats()
    loop.dist.barrier(group=loop.sync)
    begin = policy.begin("rollout")
    loop.dist.barrier(group=loop.sync)
    end = policy.end("rollout")
    loop.dist.barrier(group=loop.sync)
    after = host_backup.stats()

    def delta(name):
        return (after.get(name, 0) - before.get(name, 0)) if after else None

    return {"suspend_s": begin.wall_seconds, "resume_s": end.wall_seconds,
            "bytes": begin.nccl_bytes, "pin_thread_s": (delta("pin_ns") or 0) / 1e9,
            "unpin_thread_s": (delta("unpin_ns") or 0) / 1e9, "reused": delta("reused"),
            "pinned_new": delta("pinned_new"), "zero_skipped": delta("zero_skipped")}


def copy_floor(nbytes: int, device, repeats: int = 3) -> dict:
    """Seconds to copy ``nbytes`` device -> pinned host -> device (torch's own pinned
    memory, allocated before timing), and to zero them on the host as NCCL does
    (one memset): the parts of a cycle no backup reuse removes. (On a CPU device the
    same steps run host to host: only the code is exercised there.)"""
    if not nbytes:
        return {}
    on_gpu = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(copy) -> float:
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    d2h, h2d, zero = [], [], []
    for _ in range(repeats):
        d2h.append(timed(lambda: host.copy_(dev)))
        h2d.append(timed(lambda: dev.copy_(host)))
        start = time.perf_counter()
        ctypes.memset(host.data_ptr(), 0, nbytes)
        zero.append(time.perf_counter() - start)
    del host, dev
    return {"d2h_s": min(d2h), "h2d_s": min(h2d), "memset_s": min(zero)}


def backup_cycles(loop, backend: str, workers: int, cycles: int) -> dict:
    """Collective over the bench's ranks: blocks off, on, off, on of ``cycles`` warm
    cycles each (plus a warm-up cycle), with the package's worker threads."""
    policy = OffloadPolicy(backend=backend, keep=["tp"], workers=workers,
                           groups=loop.all_groups())
    if not host_backup.active():
        return {"skipped": host_backup.why_inactive() or "the backend suspends nothing"}
    blocks = []
    for reuse in (False, True, False, True):
        host_backup.set_reuse(reuse)
        rows = [_cycle(loop, policy) for _ in range(cycles + 1)]
        blocks.append({"reuse": reuse, "warm_up": rows[0], "cycles": rows[1:]})
    host_backup.release()
    nbytes = max(row["bytes"] for b in blocks for row in b["cycles"])
    loop.dist.barrier(group=loop.sync)
    floor = copy_floor(nbytes, loop.device)
    loop.dist.barrier(group=loop.sync)
    return {"blocks": blocks, "bytes": nbytes, "workers": workers, "floor": floor,
            "first_cycle": blocks[0]["warm_up"], "summary": summarise(blocks, nbytes, floor)}


def summarise(blocks: list, nbytes: int, floor: dict) -> dict:
    """Medians of the warm cycles per side, per GiB, and their ratios."""
    def side(reuse: bool, key: str) -> float:
        return statistics.median(row[key] for b in blocks if b["reuse"] is reuse
                                 for row in b["cycles"])

    gib = nbytes / GIB if nbytes else None
    out = {}
    for reuse, name in ((False, "off"), (True, "on")):
        suspend, resume = side(reuse, "suspend_s"), side(reuse, "resume_s")
        out[name] = {"suspend_s": suspend, "resume_s": resume, "cycle_s": suspend + resume,
                     "cycle_s_per_gib": (suspend + resume) / gib if gib else None,
                     "pin_thread_s": side(reuse, "pin_thread_s"),
                     "unpin_thread_s": side(reuse, "unpin_thread_s")}
    copy = floor.get("d2h_s", 0) + floor.get("h2d_s", 0)
    out["copy_s"] = copy or None
    out["copy_s_per_gib"] = copy / gib if copy and gib else None
    out["on_over_copy"] = out["on"]["cycle_s"] / copy if copy else None
    out["off_over_on"] = out["off"]["cycle_s"] / out["on"]["cycle_s"]
    return out
