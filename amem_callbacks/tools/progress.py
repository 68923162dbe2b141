"""How fast the caller's thread runs Python while something else is in flight.

The measure behind "no call into NCCL may hold the GIL": a pure-Python loop
counts in short slices before a transition and while it runs; the ratio of
the median rates is near 1 when the transition's thread releases the GIL and
falls towards 0 when it holds it (torch's own suspend(): 0.03-0.07 measured).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional


def rate_slices(stop: Callable[[], bool], slice_s: float = 0.05) -> list:
    """Loop iterations per second in consecutive slices, until ``stop()``."""
    rates = []
    while not stop():
        n, end = 0, time.perf_counter() + slice_s
        while time.perf_counter() < end:
            n += 1
        rates.append(n / slice_s)
    return rates


def progress_during(start: Callable, running: Callable[[object], bool],
                    baseline_s: float = 0.5) -> dict:
    """``start()`` launches something in the background and returns a handle;
    ``running(handle)`` says whether it still runs. Returns the ratio of this
    thread's Python rate while it ran to its rate just before."""
    deadline = time.perf_counter() + baseline_s
    normal = rate_slices(lambda: time.perf_counter() > deadline)
    handle = start()
    during = rate_slices(lambda: not running(handle))
    ratio: Optional[float] = (statistics.median(during) / statistics.median(normal)
                              if during else None)
    return {"ratio": ratio, "slices": len(during), "handle": handle}
