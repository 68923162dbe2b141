"""NCCL's own communicator suspend (NCCL >= 2.29.7) on torch's communicators.

The calls go to the ``libnccl.so.2`` torch already loaded, on the handle that
``ProcessGroupNCCL._comm_ptr()`` returns, so they act on exactly the
communicators torch runs collectives on. The version that counts is the
loaded library's (``ncclGetVersion``): ``torch.cuda.nccl.version()`` reports
the version torch was built with, which can differ.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from ..errors import BackendUnavailable
from ..nccl_library import (
    STAT_PERSIST, STAT_SUSPENDABLE, STAT_SUSPENDED, STAT_TOTAL, SUSPEND_MIN_VERSION,
    NcclLibrary, version_string,
)
from .base import Backend, CommMemory


def suspend_capable_nccl_fix() -> str:
    """The pip command that brings a suspend-capable NCCL for this torch's CUDA."""
    cuda_major = "13"
    try:
        import torch

        if torch.version.cuda:
            cuda_major = torch.version.cuda.split(".")[0]
    except ImportError:
        pass
    return (f"pip install -U 'nvidia-nccl-cu{cuda_major}>="
            f"{version_string(SUSPEND_MIN_VERSION)}' (torch loads the NCCL of that wheel)")


def cumem_disabled() -> bool:
    """NCCL_CUMEM_ENABLE=0 makes suspend succeed while freeing nothing (measured)."""
    return os.environ.get("NCCL_CUMEM_ENABLE", "").strip() == "0"


class TorchComm:
    """torch's own NCCL backend object of a group (torch >= 2.12 has
    ``suspend/resume/memory_stats`` on it); ``ptr`` is its ``ncclComm_t``."""

    __slots__ = ("backend", "ptr")

    def __init__(self, backend, ptr: int):
        self.backend = backend
        self.ptr = ptr


def torch_has_native_suspend() -> bool:
    from torch._C import _distributed_c10d as c10d_ext

    return all(hasattr(c10d_ext.Backend, name) for name in ("suspend", "resume", "memory_stats"))


def torch_comm_handle(group) -> tuple:
    """``(handle, None)`` for an NCCL group with a communicator on this device,
    else ``(None, why)``. The handle is a :class:`TorchComm` where torch can
    suspend it itself, else the raw ``ncclComm_t`` as an int."""
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        backend = group._get_backend(torch.device("cuda", torch.cuda.current_device()))
    except RuntimeError:
        return None, "not an NCCL group"
    comm_ptr = getattr(backend, "_comm_ptr", None)
    if comm_ptr is None:
        return None, "not an NCCL group"
    handle = comm_ptr()
    if not handle:
        return None, "its NCCL communicator is not created yet (no collective has run on it)"
    if torch_has_native_suspend():
        return TorchComm(backend, handle), None
    return handle, None


class NcclBackend(Backend):
    """``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`` / ``ncclCommResume(comm)`` per group.

    Args:
        library: the NCCL to call; default: the one already loaded in the
            process. Tests pass a stand-in library.
        handle_of: maps a process group to ``(handle, why_not)``; default:
            torch's ``_comm_ptr()`` on the current CUDA device.
    """

    name = "nccl"

    def __init__(self, library: Optional[NcclLibrary] = None,
                 handle_of: Optional[Callable] = None):
        self._library = library
        self._handle_of = handle_of or torch_comm_handle

    @property
    def library(self) -> NcclLibrary:
        if self._library is None:
            raise BackendUnavailable("the nccl backend was used before check()")
        return self._library

    def check(self) -> str:
        if self._library is None:
            self._library = NcclLibrary.loaded()
        lib = self._library
        if lib is None:
            raise BackendUnavailable(
                "no NCCL library is loaded in this process (a CPU-only torch, or torch "
                "has not loaded NCCL).", "use a CUDA build of torch; " + suspend_capable_nccl_fix())
        if not lib.has_suspend or lib.version < SUSPEND_MIN_VERSION:
            raise BackendUnavailable(
                f"the NCCL torch loaded ({lib.path}, {lib.version_str}) has no ncclCommSuspend; "
                f"it needs NCCL >= {version_string(SUSPEND_MIN_VERSION)}.",
                suspend_capable_nccl_fix())
        if cumem_disabled():
            raise BackendUnavailable(
                "NCCL_CUMEM_ENABLE=0: NCCL allocates without cuMem, so suspend would "
                "succeed and free nothing.",
                "unset NCCL_CUMEM_ENABLE (or set it to 1) before the first NCCL "
                "communicator is created")
        return f"NCCL {lib.version_str} from {lib.path}, ncclCommSuspend present, cuMem on"

    def communicator(self, group) -> tuple:
        return self._handle_of(group)

    def memory(self, handle) -> Optional[CommMemory]:
        if isinstance(handle, TorchComm):
            stats = handle.backend.memory_stats()
            return CommMemory(suspendable=int(stats["suspend"]), persist=int(stats["persist"]),
                              total=int(stats["total"]), suspended=bool(stats["suspended"]))
        lib = self.library
        return CommMemory(
            suspendable=lib.comm_mem_stat(handle, STAT_SUSPENDABLE),
            persist=lib.comm_mem_stat(handle, STAT_PERSIST),
            total=lib.comm_mem_stat(handle, STAT_TOTAL),
            suspended=bool(lib.comm_mem_stat(handle, STAT_SUSPENDED)),
        )

    # torch's methods take torch's lock on the communicator; prefer them.
    def suspend(self, handle) -> None:
        if isinstance(handle, TorchComm):
            handle.backend.suspend()
        else:
            self.library.comm_suspend(handle)

    def resume(self, handle) -> None:
        if isinstance(handle, TorchComm):
            handle.backend.resume()
        else:
            self.library.comm_resume(handle)
