"""How fast the caller's thread runs Python while something else is in flight.

The measure behind "no call into NCCL may hold the GIL": a pure-Python loop
counts in short slices around a transition and while it runs; the ratio of
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
        n, begun = 0, time.perf_counter()
        end = begun + slice_s
        while (now := time.perf_counter()) < end:
            n += 1
        # over the time the slice really took: a thread that held the GIL past
        # the slice's end stretched it, and that time ran nothing here
        rates.append(n / (now - begun))
    return rates


def progress_during(start: Callable, running: Callable[[object], bool],
                    baseline_s: float = 0.5) -> dict:
    """``start()`` launches something in the background and returns a handle;
    ``running(handle)`` says whether it still runs. Returns the ratio of this
    thread's Python rate while it ran to its rate around it: the baseline is
    read just before and just after, so a load that comes or goes on a shared
    host (another job's threads) moves both sides of the ratio, not one."""
    before = _slices_for(baseline_s / 2)
    handle = start()
    during = rate_slices(lambda: not running(handle))
    after = _slices_for(baseline_s / 2)
    ratio: Optional[float] = (statistics.median(during) / statistics.median(before + after)
                              if during else None)
    return {"ratio": ratio, "slices": len(during), "handle": handle}


def _slices_for(seconds: float) -> list:
    deadline = time.perf_counter() + seconds
    return rate_slices(lambda: time.perf_counter() > deadline)


#: transitions measured a side: a shared GPU is noisy, and a quick bench's transition
#: lasts 4-6 slices (one reading of 4 went 0.64 where its neighbours read 0.92-1.06)
REPEATS = 3


def transition_progress(policy, barrier: Callable[[], None], repeats: int = REPEATS,
                        phase: str = "rollout") -> dict:
    """The caller's progress during ``repeats`` overlapped begin/end cycles of ``policy``
    (``barrier()`` lines the ranks up before each): per kind, every run and their
    median ("ratio"). The first begin is listed too: it may pin NCCL's host backup
    afresh, which the later ones, with the backup kept, do not."""
    rows: dict = {"begin": [], "end": []}
    for _repeat in range(repeats):
        for kind in ("begin", "end"):
            barrier()
            measured = progress_during(
                lambda: policy.begin(phase) if kind == "begin" else policy.end(phase),
                lambda report: report.pending)
            report = measured.pop("handle")
            policy.wait()
            rows[kind].append({**measured, "transition_s": report.wall_seconds,
                               "gil_held": report.gil_held,
                               "paths": sorted({g.path for g in report.groups if g.path})})
    out = {}
    for kind, runs in rows.items():
        ratios = [r["ratio"] for r in runs if r["ratio"] is not None]
        out[kind] = {"ratio": statistics.median(ratios) if ratios else None,
                     "first_ratio": runs[0]["ratio"], "runs": runs,
                     "gil_held": any(r["gil_held"] for r in runs),
                     "paths": sorted({p for r in runs for p in r["paths"]})}
    return out
