"""How a process group's NCCL communicator is reached, on every torch that users run.

Read from the torch 2.11-2.15 wheels (class attributes, pybind registrations):

=================  ==========================  ==============  ===================
torch              ``_get_backend(cuda)``      ``_comm_ptr()``  ``suspend()``
=================  ==========================  ==============  ===================
2.11               ProcessGroupNCCL            yes              no
2.12 - 2.14        ProcessGroupNCCL            yes              yes, holds the GIL
2.14 (opt-in)      ProcessGroupNCCL2 (nccl2)   **no**           yes, holds the GIL
2.15 (default)     ProcessGroupNCCL2 (nccl2)   yes              yes, holds the GIL
2.15 nccl-lazy     ProcessGroupNCCLLazy        primary only     primary + pair comms
2.15 nccl-legacy   ProcessGroupNCCL            yes              yes, holds the GIL
=================  ==========================  ==============  ===================

torch's ``suspend()``/``resume()``/``memory_stats()`` bindings carry no
``gil_scoped_release``: every Python thread of the process stops for the whole
NCCL call (seconds). So the default path calls NCCL's own symbols through
ctypes (which releases the GIL) on the pointer ``_comm_ptr()`` gives, and
torch's methods are used only where no pointer can be had. That is decided
per backend object from what it offers, never from a version string.

Two torch details the ctypes path relies on:
- legacy ``_comm_ptr()`` returns the communicator of the *current* CUDA
  device, so it is read on a thread bound to the rank's device;
- nccl2's pointer is 0 until the communicator exists (``lazy_init``); torch's
  own ``suspend()`` would create it first (a collective), ours keeps it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Path(str, enum.Enum):
    """How the nccl backend acts on one group's communicator."""

    CTYPES = "ctypes"  # ncclCommSuspend on torch's pointer; GIL released
    TORCH = "torch-native"  # torch's Backend.suspend(); holds the GIL


#: ``NcclBackend(path=...)`` choices: which path wins where both are possible.
PATH_CHOICES = ("auto", "ctypes", "torch")


@dataclass(frozen=True)
class Reach:
    """What one torch backend object allows."""

    path: Optional[Path]
    why: str  # why this path (or why none), for reports and the doctor
    #: what the path leaves untouched, e.g. nccl-lazy's per-peer communicators
    unreached_why: str = ""


def _kind(torch_backend) -> str:
    """The class name; works on a class too (the doctor asks about classes,
    since building an nccl2 object without a GPU aborts the interpreter)."""
    return (torch_backend if isinstance(torch_backend, type) else type(torch_backend)).__name__


def _is_nccl(torch_backend) -> bool:
    if "NCCL" in _kind(torch_backend).upper():
        return True
    if isinstance(torch_backend, type):
        return False
    try:
        return "nccl" in str(torch_backend.name()).lower()
    except Exception:
        return False


def _callable(obj, name: str) -> bool:
    return callable(getattr(obj, name, None))


def unwrap(torch_backend):
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps every backend in a
    ``_ProcessGroupWrapper`` that has no ``_comm_ptr``; its ``wrapped_pg`` is
    the NCCL backend that owns the communicator."""
    for _ in range(4):  # wrappers do not nest deeper in practice
        inner = getattr(torch_backend, "wrapped_pg", None)
        if inner is None or inner is torch_backend:
            return torch_backend
        torch_backend = inner
    return torch_backend


def how_to_reach(torch_backend, prefer: str = "auto") -> Reach:
    """The path for one torch backend object, from the methods it has.

    Args:
        torch_backend: what ``group._get_backend(cuda_device)`` returned.
        prefer: "auto" (ctypes where a pointer exists, else torch's own
            methods), "ctypes" (never torch's GIL-holding methods), or
            "torch" (torch's methods where they exist: they also reach
            nccl-lazy's per-peer communicators).
    """
    if not _is_nccl(torch_backend):
        return Reach(None, f"not an NCCL group ({_kind(torch_backend)})")
    kind = _kind(torch_backend)
    has_ptr = _callable(torch_backend, "_comm_ptr")
    has_native = all(_callable(torch_backend, n) for n in ("suspend", "resume", "memory_stats"))
    lazy_pairs = "Lazy" in kind
    unreached_why = ("nccl-lazy's per-peer point-to-point communicators: torch gives only the "
                 "primary communicator's pointer" if lazy_pairs else "")
    if prefer == "torch" and has_native:
        return Reach(Path.TORCH, f"{kind}: torch's own suspend() (asked for with path='torch'; "
                                 "holds the GIL)")
    if has_ptr:
        return Reach(Path.CTYPES, f"{kind}._comm_ptr() -> ncclCommSuspend via ctypes "
                                  "(GIL released)", unreached_why)
    if has_native and prefer != "ctypes":
        return Reach(Path.TORCH, f"{kind} exposes no communicator pointer (torch 2.14's nccl2): "
                                 "torch's own suspend(), which holds the GIL")
    if has_native:
        return Reach(None, f"{kind} exposes no communicator pointer and path='ctypes' forbids "
                           "torch's GIL-holding suspend()")
    return Reach(None, f"{kind} has neither a communicator pointer nor suspend() (torch < 2.8?)")


def nccl_classes() -> dict:
    """Every NCCL backend class this torch has -> how the nccl backend reaches it."""
    try:
        from torch._C import _distributed_c10d as c10d_ext  # optional: a torch without c10d
    except ImportError:
        return {}
    return {name: how_to_reach(getattr(c10d_ext, name)) for name in sorted(dir(c10d_ext))
            if name.startswith("ProcessGroupNCCL") and isinstance(getattr(c10d_ext, name), type)}


def torch_backend_of(group, device: int):
    """``(torch backend object, None)`` of ``group`` on CUDA ``device``, else ``(None, why)``."""
    import torch  # light import: torch

    try:
        backend = group._get_backend(torch.device("cuda", device))
    except (RuntimeError, ValueError) as exc:
        return None, f"not an NCCL group (no CUDA backend: {exc})"
    return unwrap(backend), None


def read_pointer(torch_backend) -> int:
    """The ``ncclComm_t`` torch holds now, or 0 (not created, or gone)."""
    return int(torch_backend._comm_ptr() or 0)


def torch_memory_stats(torch_backend) -> Optional[dict]:
    """torch's own account (torch >= 2.12; nccl-lazy sums primary and pair
    communicators), or None where torch cannot give it."""
    if not _callable(torch_backend, "memory_stats"):
        return None
    try:
        return {k: int(v) for k, v in torch_backend.memory_stats().items()}
    except Exception:  # "Backend ... does not support getMemoryStats", old NCCL
        return None
