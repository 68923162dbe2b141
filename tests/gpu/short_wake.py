"""A forced short KV wake-up for tests/gpu/trl_vllm_gpu.py (``--short-wake G:R``).

Where every rank judged that vLLM's KV cache fits and skipped its begin, another
process can still take the memory before vLLM maps it. The package then mends it:
every rank learns it in one store round and begins, and the short rank wakes
again (adapters/trl.py, ``_wake_after_skipped_begin``). This takes memory the way
that other process would, between the package's decision and vLLM's mapping, so
that a GPU run shows the mend working: one warning line, one
``amem/total/begins_after_short_allocation``, and the run going on.

How much: at generation G, on rank R, before the spies' barrier (so no rank on
the GPU has mapped yet), enough that the wake-ups of every rank sharing the GPU
lack ``SHORT_BY`` bytes. One of them runs out of memory (whichever maps last),
the suspends of every rank on the GPU then free far more than ``SHORT_BY``, and
the retry fits. The memory stays taken until this rank's wake-up has returned.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

#: what the wake-ups lack once the memory is taken: far below what the suspends free
#: (1.125 GiB a rank on one H100, results/one_h100/trl_vllm_colocate_kv)
SHORT_BY = 256 << 20


def parse_short_wake(text: str) -> tuple:
    """``G:R`` (generation G >= 2, counted from 1; rank R >= 0) -> (G, R). The first
    generation's begin always runs, so only a later one can have been skipped."""
    try:
        generation, rank = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--short-wake {text!r}: write GENERATION:RANK, e.g. 2:1 (the second "
            "generation's KV wake-up on rank 1)") from None
    if generation < 2 or rank < 0:
        raise argparse.ArgumentTypeError(
            f"--short-wake {text!r}: the generation counts from 1 and must be at least 2 "
            "(the first begin always runs), the rank at least 0: e.g. 2:1")
    return generation, rank


class ShortWake:
    """Takes memory at one KV wake-up, where the package skipped its begin.

    ``take(nbytes)`` holds device memory and returns what releases it;
    ``begin_skipped()`` says whether this generation's begin was skipped;
    ``wake_bytes(tags)`` what vLLM maps for ``tags`` (None: unknown)."""

    def __init__(self, at: tuple, rank: int, ranks_on_gpu: int, take: Callable,
                 begin_skipped: Callable[[], bool], wake_bytes: Callable):
        self.generation, self.rank = at
        self.here = rank == self.rank
        self.ranks_on_gpu = max(1, ranks_on_gpu)
        self._take, self._begin_skipped, self._wake_bytes = take, begin_skipped, wake_bytes
        self._release: Optional[Callable] = None

    def before_wake(self, generation: int, tags, free: Optional[int]) -> Optional[dict]:
        """At generation ``generation``'s first KV wake-up attempt: what was taken
        (a record for the rank JSON), or None where this is not the wake-up asked
        for. Taken only where the begin was skipped: after a begin that ran, the
        package waited for what lacked and does not mend a later shortfall."""
        if not self.here or generation != self.generation:
            return None
        need = self._wake_bytes(tags)
        record = {"generation": generation, "need_bytes": need, "free_bytes": free,
                  "taken_bytes": 0}
        if not self._begin_skipped():
            record["why_not"] = "the begin ran (only a skipped begin's shortfall is mended)"
            return record
        if need is None or free is None:
            record["why_not"] = "vLLM's mapping or the free memory is unknown"
            return record
        nbytes = free - self.ranks_on_gpu * need + SHORT_BY
        if nbytes <= 0:
            record["why_not"] = "the free memory is short already"
            return record
        self._release = self._take(nbytes)
        record["taken_bytes"] = nbytes
        return record

    def after_wake(self) -> bool:
        """The wake-up returned: give the memory back. True where any was held."""
        release, self._release = self._release, None
        if release is None:
            return False
        release()
        return True


def device_taker(device: str) -> Callable:
    """``take`` on a GPU: a torch allocation on ``device`` ("cuda:N"), handed back to
    CUDA at release (the caching allocator would keep it otherwise)."""
    def take(nbytes: int) -> Callable:
        import torch

        held = [torch.empty(nbytes, dtype=torch.uint8, device=device)]

        def release() -> None:
            held.clear()
            torch.cuda.empty_cache()

        return release

    return take


def stand_in_taker(ledger: list) -> Callable:
    """``take`` in the CPU mode: the bytes go to ``ledger`` (no device to take from)."""
    def take(nbytes: int) -> Callable:
        ledger.append(nbytes)
        return lambda: ledger.append(-nbytes)

    return take
