"""What a colocated vLLM engine is about to take when it wakes its KV cache.

A begin that waits for every suspend before vLLM's KV wake-up makes the rollout
wait for NCCL's copy to pinned host memory, which can lengthen a whole step
(docs/evidence.md). The wait is needed only where the free memory cannot
hold what the wake-up maps. vLLM's own allocator knows that size: its sleep mode
keeps every cuMem allocation it made, tagged ("weights", "kv_cache") and marked
asleep, in ``CuMemAllocator``'s singleton (vllm/device_allocator/cumem.py, the
same fields since vLLM 0.8; ``is_asleep`` since 0.2x, absent before: then every
kept allocation is asleep between sleep and wake-up).

Nothing here imports vLLM: it is read only where the trainer has loaded it.
Every reading that cannot be made returns None, and the caller then waits for
the whole begin, as before.
"""

from __future__ import annotations

import sys
from typing import Iterable, Optional

_CUMEM = "vllm.device_allocator.cumem"


def _allocations():
    module = sys.modules.get(_CUMEM)
    allocator = getattr(getattr(module, "CuMemAllocator", None), "instance", None)
    table = getattr(allocator, "pointer_to_data", None)
    return list(table.values()) if isinstance(table, dict) else None


def _size(data) -> int:
    return int(data.handle[1])  # (device, aligned size, pointer, handle)


def wake_bytes(tags: Optional[Iterable[str]]) -> Optional[int]:
    """Bytes vLLM maps when it wakes ``tags`` (None: every tag) now; None when
    unknown (vLLM not loaded, another sleep backend, nothing asleep to wake)."""
    rows = _allocations()
    if not rows:
        return None
    wanted = None if tags is None else set(tags)
    try:
        asleep = [d for d in rows if getattr(d, "is_asleep", True)
                  and (wanted is None or d.tag in wanted)]
        return sum(_size(d) for d in asleep) if asleep else None
    except (AttributeError, IndexError, TypeError, ValueError):
        return None  # a layout this module does not know: wait, as before


def awake_bytes() -> Optional[int]:
    """Bytes of vLLM's cuMem allocations mapped now (its weights, once woken); None
    where vLLM does not say which are (before ``is_asleep``): the caller then counts
    none as mapped, which overstates what comes."""
    rows = _allocations()
    if rows is None or not all(hasattr(d, "is_asleep") for d in rows):
        return None
    try:
        return sum(_size(d) for d in rows if not d.is_asleep)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def upcoming_bytes(tags: Optional[Iterable[str]], share: Optional[float],
                   total_bytes: Optional[int],
                   generation_bytes: Optional[int] = None) -> Optional[int]:
    """What vLLM may take from the free memory between its wake-up of ``tags`` and
    the end of generation: the KV cache it maps, plus ``generation_bytes`` where an
    earlier generation measured what it took beyond its wake-up (activations,
    sampler buffers); else the KV cache or, where larger, the rest of its budget
    (``share`` x the GPU's ``total_bytes``, which vLLM's start-up profile filled with
    weights, activations, CUDA graphs and the cache) less what it has mapped
    already, so a generation's activations count too, and so does what stays
    allocated through sleep (CUDA graphs): that rule overstates it, so a begin may
    wait for a suspend nothing needed; the measured take is preferred. None when
    nothing is known."""
    kv = wake_bytes(tags)
    if kv is not None and generation_bytes is not None:
        return kv + max(0, generation_bytes)
    rest = None
    if share is not None and total_bytes:
        mapped = awake_bytes() or 0
        rest = max(0, int(share * total_bytes) - mapped)
    known = [x for x in (kv, rest) if x is not None]
    return max(known) if known else None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a CUDA allocation that found too little free memory:
    vLLM's cuMem wake-up raises ``RuntimeError("CUDA Error: out of memory at
    .../cumem_allocator.cpp:...")`` (0.31, measured), torch its OutOfMemoryError (a
    RuntimeError too). Nothing else counts: other failures are not the begin's to mend,
    and the host's MemoryError least of all (a suspend copies to host memory)."""
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
