"""One real suspend/resume on a 1-rank NCCL communicator, in its own process.

``amem-callbacks doctor`` runs this (``python -m amem_callbacks.tools.probe``)
on a machine with CUDA: it is the only way to know which class torch's
``"nccl"`` backend really creates here, which path the nccl backend takes on
it, and whether the loaded NCCL suspends a communicator torch made. A crash
(an NCCL mismatch) ends this process, not the doctor. Prints one JSON line.
Only run as that command (nothing imports it), so it imports torch at the top.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from .. import host_backup
from ..backends.nccl import NcclBackend
from ..backends.torch_comms import torch_backend_of
from .launch import free_port


def probe(backend_name: str = "nccl") -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")
    torch.cuda.set_device(0)
    host_backup.install()  # before the communicator, as the adapters do
    dist.init_process_group(backend_name, rank=0, world_size=1)
    out = {"torch_backend": backend_name}
    try:
        t = torch.ones(1, device="cuda")
        dist.all_reduce(t)  # creates the communicator
        torch_backend, why = torch_backend_of(dist.group.WORLD, 0)
        out["class"] = type(torch_backend).__name__ if torch_backend is not None else None
        backend = NcclBackend()
        backend.device = 0
        out["check"] = backend.check()
        handle, why = backend.communicator(dist.group.WORLD)
        if handle is None:
            out.update(ok=False, error=why)
            return out
        out.update(path=handle.path.value, why=handle.why)
        before = backend.memory(handle)
        # the bound first, as the policy sets it at a begin: a resume keeps only what fits
        # it, and it starts at 0, so a bound set after the first cycle keeps nothing (that
        # resume unpins every block) and the second suspend pins afresh: reused reads 0
        host_backup.bound(before.suspendable)
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        backend.suspend(handle)
        free1 = torch.cuda.mem_get_info()[0]
        out["suspended_per_nccl"] = backend.memory(handle).suspended
        backend.resume(handle)
        backend.suspend(handle)  # a second cycle: the backup comes from the first one's
        backend.resume(handle)
        out["host_backup"] = {"kept": host_backup.active(), "why_not": host_backup.why_inactive(),
                              "reused": host_backup.stats().get("reused", 0)}
        host_backup.release()
        t.fill_(3.0)
        dist.all_reduce(t)
        out.update(suspendable_bytes=before.suspendable, persist_bytes=before.persist,
                   device_freed_bytes=free1 - free0, exact_after=float(t.item()) == 3.0,
                   ok=bool(out["suspended_per_nccl"]) and float(t.item()) == 3.0)
    except Exception as exc:  # reported, never raised: the doctor explains it
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()
    return out


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "nccl"
    print(json.dumps(probe(name)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
