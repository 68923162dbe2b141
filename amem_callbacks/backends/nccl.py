"""NCCL's own communicator suspend (NCCL >= 2.29.7) on torch's communicators.

The calls go to the ``libnccl.so.2`` torch already loaded, on the pointer
torch's backend object gives (``_comm_ptr()``, re-read before every call), so
they act on exactly the communicators torch runs collectives on, and through
ctypes, which releases the GIL for the call: the caller's thread keeps
running while a suspend waits in NCCL's barriers. torch's own
``Backend.suspend()`` (torch >= 2.12) holds the GIL for seconds; it is used
only where torch gives no pointer (see :mod:`.torch_comms`).

The version that counts is the loaded library's (``ncclGetVersion``):
``torch.cuda.nccl.version()`` reports the version torch was built with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

from .. import host_backup
from ..availability import is_cuda_available, loaded_torch
from ..errors import BackendUnavailable, NcclError
from ..nccl_library import (
    STAT_PERSIST, STAT_SUSPENDABLE, STAT_SUSPENDED, STAT_TOTAL, SUSPEND_MIN_VERSION,
    NcclLibrary, version_string,
)
from .base import Backend, CommMemory
from .torch_comms import PATH_CHOICES, Path, how_to_reach, read_pointer, torch_backend_of, \
    torch_memory_stats, unwrap


def suspend_capable_nccl_fix() -> str:
    """The pip command that brings a suspend-capable NCCL for this torch's CUDA."""
    cuda_major = "13"
    try:
        import torch  # optional: torch may be missing; the fix names cu13 then

        if torch.version.cuda:
            cuda_major = torch.version.cuda.split(".")[0]
    except ImportError:
        pass
    return (f"pip install -U 'nvidia-nccl-cu{cuda_major}>="
            f"{version_string(SUSPEND_MIN_VERSION)}' (torch loads the NCCL of that wheel)")


def cumem_disabled() -> bool:
    """NCCL_CUMEM_ENABLE=0 makes suspend succeed while freeing nothing (measured)."""
    return os.environ.get("NCCL_CUMEM_ENABLE", "").strip() == "0"


class CommunicatorGone(NcclError):
    """The group's communicator was destroyed, aborted or replaced since it was found."""

    def __init__(self, text: str):
        super().__init__("communicator lookup", -1, text)


@dataclass(eq=False)
class CommHandle:
    """One group's communicator as the nccl backend reaches it.

    The pointer is re-read from torch right before every NCCL call, so an
    aborted or destroyed group gives :class:`CommunicatorGone`, never a call
    on a freed ``ncclComm_t``.
    """

    torch_backend: object
    path: Path
    why: str
    ptr: int = 0  # at discovery; 0 on the torch-native path
    unreached_why: str = ""
    suspended_ptr: int = 0  # what suspend acted on; resume must find the same one

    @property
    def holds_gil(self) -> bool:
        return self.path is Path.TORCH

    @property
    def identity(self):
        """Two groups with the same identity share one communicator."""
        return self.ptr or id(self.torch_backend)

    def current(self, what: str) -> int:
        try:
            ptr = read_pointer(self.torch_backend)
        except Exception as exc:  # torch raises for an aborted communicator
            raise CommunicatorGone(f"{what}: torch no longer gives this group's communicator "
                                   f"({exc}); the group was aborted or destroyed") from None
        if not ptr:
            raise CommunicatorGone(f"{what}: the group has no communicator any more (destroyed "
                                   "or aborted)")
        return ptr


def torch_comm_handle(group, prefer: str = "auto", device: Optional[int] = None) -> tuple:
    """``(CommHandle, None)`` for an NCCL group with a communicator on this
    rank's device, else ``(None, why)``."""
    if not is_cuda_available():
        return None, "no CUDA device"
    if device is None:
        device = loaded_torch().cuda.current_device()
    torch_backend, why = torch_backend_of(group, device)
    if torch_backend is None:
        return None, why
    return handle_for(torch_backend, prefer)


def handle_for(torch_backend, prefer: str = "auto") -> tuple:
    """``(CommHandle, None)`` or ``(None, why)`` for one torch backend object
    (split out so tests can hand in objects shaped like each torch's)."""
    torch_backend = unwrap(torch_backend)
    reach = how_to_reach(torch_backend, prefer)
    if reach.path is None:
        return None, reach.why
    if reach.path is Path.TORCH:
        return CommHandle(torch_backend, Path.TORCH, reach.why, unreached_why=reach.unreached_why), None
    ptr = read_pointer(torch_backend)
    if not ptr:
        return None, "its NCCL communicator is not created yet (no collective has run on it)"
    return CommHandle(torch_backend, Path.CTYPES, reach.why, ptr, reach.unreached_why), None


class NcclBackend(Backend):
    """``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`` / ``ncclCommResume(comm)`` per group.

    Args:
        library: the NCCL to call; default: the one already loaded in the
            process. Tests pass a stand-in library.
        handle_of: maps a process group to ``(handle, why_not)``; default:
            torch's communicator of the group on this rank's device (see
            :mod:`~amem_callbacks.backends.torch_comms`).
        path: "auto" (NCCL's symbols via ctypes wherever torch gives the
            communicator pointer, torch's own GIL-holding ``suspend()`` only
            where it does not), "ctypes" (never torch's methods), or "torch"
            (torch's methods wherever they exist; they also reach nccl-lazy's
            per-peer communicators, at the price of the GIL).
    """

    name = "nccl"

    @staticmethod
    def check_options(library=None, handle_of=None, path: str = "auto") -> None:
        """Raise ValueError naming the fix for a bad option value."""
        if path not in PATH_CHOICES:
            raise ValueError(f"unknown nccl path {path!r}: write one of "
                             f"{', '.join(map(repr, PATH_CHOICES))}")
        if handle_of is not None and not callable(handle_of):
            raise ValueError(f"handle_of must be a function of a process group, got {handle_of!r}")

    def __init__(self, library: Optional[NcclLibrary] = None,
                 handle_of: Optional[Callable] = None, path: str = "auto"):
        self.check_options(library, handle_of, path)
        self._library = library
        self.path = path
        self.device: Optional[int] = None  # set by the policy: the rank's CUDA device
        self._handle_of = handle_of or (
            lambda group: torch_comm_handle(group, self.path, self.device))

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

    def holds_gil(self, handle) -> bool:
        return getattr(handle, "holds_gil", False)

    def path_of(self, handle) -> str:
        return handle.path.value if isinstance(handle, CommHandle) else Path.CTYPES.value

    def memory(self, handle) -> Optional[CommMemory]:
        if isinstance(handle, CommHandle) and handle.path is Path.TORCH:
            stats = torch_memory_stats(handle.torch_backend)
            return None if stats is None else _from_torch_stats(stats)
        ptr = handle.current("ncclCommMemStats") if isinstance(handle, CommHandle) else handle
        lib = self.library
        memory = CommMemory(
            suspendable=lib.comm_mem_stat(ptr, STAT_SUSPENDABLE),
            persist=lib.comm_mem_stat(ptr, STAT_PERSIST),
            total=lib.comm_mem_stat(ptr, STAT_TOTAL),
            suspended=bool(lib.comm_mem_stat(ptr, STAT_SUSPENDED)),
        )
        if isinstance(handle, CommHandle) and handle.unreached_why:
            # nccl-lazy: torch's stats sum the primary and the per-peer communicators.
            stats = torch_memory_stats(handle.torch_backend)
            extra = stats["total"] - memory.total if stats else 0
            if extra > 0:
                memory = replace(memory, unreached_bytes=extra, unreached_why=handle.unreached_why)
        return memory

    # Each NCCL call runs inside a host-backup window: the blocks NCCL pins for a
    # suspend may come from those its last resume freed (host_backup.py).
    def suspend(self, handle) -> None:
        with host_backup.window(host_backup.SUSPEND):
            if not isinstance(handle, CommHandle):
                self.library.comm_suspend(handle)
            elif handle.path is Path.TORCH:
                handle.torch_backend.suspend()
            else:
                ptr = handle.current("suspend")
                self.library.comm_suspend(ptr)
                handle.suspended_ptr = ptr

    def resume(self, handle) -> None:
        with host_backup.window(host_backup.RESUME):
            if not isinstance(handle, CommHandle):
                self.library.comm_resume(handle)
            elif handle.path is Path.TORCH:
                handle.torch_backend.resume()
            else:
                ptr = handle.current("resume")
                if handle.suspended_ptr and ptr != handle.suspended_ptr:
                    raise CommunicatorGone(
                        "resume: the group's communicator was replaced since it was suspended "
                        "(destroyed and created again); the suspended one no longer exists")
                self.library.comm_resume(ptr)


def _from_torch_stats(stats: dict) -> CommMemory:
    return CommMemory(suspendable=stats["suspend"], persist=stats["persist"],
                      total=stats["total"], suspended=bool(stats["suspended"]))
