"""How fast the caller's thread runs Python while something else is in flight.

The measure behind "no call into NCCL may hold the GIL": a pure-Python loop
counts in short slices around a transition and while it runs; the ratio of
the median rates is near 1 when the transition's thread releases the GIL and
falls towards 0 when it holds it (torch's own suspend(): 0.03-0.07 measured).
"""

from __future__ import annotations

import statistics
import sys
import threading
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


#: C calls shorter than this are left out of :func:`slow_c_calls` (a switch interval is 5 ms)
SLOW_CALL_S = 0.002
#: calls that wait with the GIL released: long, and no suspect
WAITS = ("acquire", "wait", "sleep", "join", "select", "poll", "recv", "accept")


def slow_c_calls(run: Callable[[], None], min_s: float = SLOW_CALL_S, top: int = 8) -> dict:
    """Which calls into C took long in any thread while ``run()`` ran: the suspects
    when the caller's progress falls with ``gil_held`` false (a torch method bound
    with pybind holds the GIL unless torch releases it; a ctypes call is no such
    call and never listed). Profiling slows every thread, so ``run`` must be a
    cycle of its own, never one whose progress is reported. Python < 3.12 sees only
    the threads started while it runs (no ``threading.setprofile_all_threads``)."""
    started, calls = {}, []
    lock = threading.Lock()

    def hook(frame, event, arg):
        if event == "c_call":
            started.setdefault(threading.get_ident(), []).append(time.perf_counter())
        elif event in ("c_return", "c_exception"):
            stack = started.get(threading.get_ident())
            if not stack:
                return
            took = time.perf_counter() - stack.pop()
            name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", repr(arg))
            if took >= min_s and not name.rsplit(".", 1)[-1].startswith(WAITS):
                with lock:
                    calls.append((round(took, 4), name, threading.current_thread().name))

    set_all = getattr(threading, "setprofile_all_threads", None)
    (set_all or threading.setprofile)(hook)
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
        (set_all or threading.setprofile)(None)
    calls.sort(reverse=True)
    return {"calls": [list(c) for c in calls[:top]], "min_s": min_s,
            "all_threads": set_all is not None}


def transition_suspects(policy, barrier: Callable[[], None], phase: str = "rollout") -> dict:
    """One more overlapped begin/end cycle of ``policy`` under :func:`slow_c_calls`:
    per kind, the long C calls while it was in flight (not timed for progress)."""
    def cycle_part(kind):
        def run():
            policy.begin(phase) if kind == "begin" else policy.end(phase)
            policy.wait()
        return run

    out = {}
    for kind in ("begin", "end"):
        barrier()
        out[kind] = slow_c_calls(cycle_part(kind))
    return out
