"""Device-wide and host memory readings taken around a transition."""

from __future__ import annotations

import contextlib
from typing import Optional

from .availability import is_cuda_available, is_cuda_initialized, loaded_torch


def device_free_bytes(device: Optional[int] = None) -> Optional[int]:
    """cudaMemGetInfo's free bytes on the current device; None without CUDA.

    Reads only when torch is already imported: a reading must never be the
    reason torch (or CUDA) gets initialised.
    """
    if not is_cuda_initialized():
        return None
    torch = loaded_torch()
    # Explicit device: transitions run on a worker thread whose current device
    # is not the caller's.
    if device is None:
        device = torch.cuda.current_device()
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def torch_reserved_bytes(device: Optional[int] = None) -> Optional[int]:
    """What torch's caching allocator holds from CUDA on ``device`` for this process
    (every pool); None where torch has not initialised CUDA. Unlike the free memory,
    other processes on the same GPU do not move it."""
    if not is_cuda_initialized():
        return None
    torch = loaded_torch()
    return torch.cuda.memory_reserved(torch.cuda.current_device() if device is None else device)


def current_device() -> Optional[int]:
    """The current CUDA device where torch has initialised CUDA, else None."""
    if not is_cuda_initialized():
        return None
    return loaded_torch().cuda.current_device()


def empty_cache() -> None:
    """Hand the caching allocator's unused blocks back to CUDA (where torch and CUDA
    are up), so that a resume finds them free."""
    if is_cuda_initialized():
        loaded_torch().cuda.empty_cache()


@contextlib.contextmanager
def on_device(device: Optional[int]):
    """Make ``device`` current on this thread for the block: torch gives a
    group's communicator for the current device, and a thread that did not
    choose one (asyncio.to_thread, a worker) starts on device 0."""
    if device is None or not is_cuda_available():
        yield
        return
    with loaded_torch().cuda.device(device):
        yield


def host_rss_bytes() -> Optional[int]:
    """Resident set size of this process (NCCL's pinned backups count here)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
