"""What this process has: torch, CUDA, torch.distributed, a framework. One place
for the checks the engine, the backends and the tools make (as accelerate's
``utils/imports.py`` does), so each question has one answer.

Nothing here imports torch: a check about torch says False while the program
has not imported it (``import amem_callbacks`` imports no torch, and a reading
must never be the reason torch or CUDA starts). Only :func:`is_importable`
looks further, and it finds a package without importing it.

Caching: an answer is kept only where it cannot change for the rest of the
process; each function says which kind it is.

- cached: whether a package is importable (True only: a package found stays
  found; one installed later is seen, since False is never kept); whether
  torch was built with CUDA devices visible and with torch.distributed (fixed
  once torch has answered, see :func:`_settled`);
- never cached: whether torch is imported yet, whether CUDA is initialised,
  whether the default process group exists. Each turns from False to True
  while the program runs (``import torch``, the first CUDA call,
  ``init_process_group``) and back (``destroy_process_group``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional

#: Packages found importable (see is_importable): found stays found.
_importable: set = set()


def loaded_torch() -> Optional[ModuleType]:
    """The torch module when the program has imported it, else None (never imports it).
    Not cached: torch may be imported at any time."""
    return sys.modules.get("torch")


def is_torch_loaded() -> bool:
    """The program has imported torch. Not cached (see loaded_torch)."""
    return loaded_torch() is not None


def is_importable(name: str) -> bool:
    """``import name`` would find the package or module, without importing it
    (a dotted name imports its parent packages, as importlib.util.find_spec does).

    Only True is cached: a package found stays found, and one installed while
    the process runs is found at the next call."""
    if name in _importable:
        return True
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package raises; so does __spec__ None
        found = False
    if found:
        _importable.add(name)
    return found


def is_torch_importable() -> bool:
    """torch is installed (whether or not it is imported yet)."""
    return is_torch_loaded() or is_importable("torch")


@functools.lru_cache(maxsize=None)
def _settled(probe) -> bool:
    """``probe()``, asked once per probe function: for torch's answers that are
    fixed once given. Keyed by the function itself, so a test (or a stand-in
    torch) that replaces ``torch.cuda.is_available`` is asked afresh."""
    return bool(probe())


def is_cuda_available() -> bool:
    """torch is imported and sees a CUDA device (``torch.cuda.is_available()``).

    False while torch is not imported (not cached then). Once torch has answered,
    the answer is cached: torch counts the devices once per process (c10's
    device_count runs cudaGetDeviceCount, which reads CUDA_VISIBLE_DEVICES at
    cuInit, once), so a later call could not answer otherwise. Not cached with
    PYTORCH_NVML_BASED_CUDA_CHECK=1, where torch asks NVML each time instead."""
    torch = loaded_torch()
    if torch is None:
        return False
    if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1":
        return bool(torch.cuda.is_available())
    return _settled(torch.cuda.is_available)


def is_cuda_initialized() -> bool:
    """CUDA is available and torch has initialised it in this process (the first
    allocation, ``set_device``...): a reading then starts nothing. Not cached:
    it turns True at torch's first CUDA call."""
    return is_cuda_available() and bool(loaded_torch().cuda.is_initialized())


def is_distributed_available() -> bool:
    """torch is imported and was built with torch.distributed. Cached once torch
    has answered (a property of the build); False, not cached, before torch is
    imported."""
    torch = loaded_torch()
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)  # import torch imports torch.distributed
    return dist is not None and _settled(dist.is_available)


def is_distributed_initialized() -> bool:
    """torch.distributed's default process group exists (``init_process_group``
    ran, ``destroy_process_group`` did not). Not cached: it changes both ways."""
    if not is_distributed_available():
        return False
    return bool(loaded_torch().distributed.is_initialized())


def cache_clear() -> None:
    """Forget every cached answer (for tests that change what torch reports)."""
    _importable.clear()
    _settled.cache_clear()
