"""tools/progress.py tells a call that holds the GIL from one that releases it.

The same C function (libc's usleep) called through ctypes.PyDLL keeps the GIL
for the whole call, through ctypes.CDLL it lets it go: the two sides of the
rule "no call into NCCL may hold the GIL", on CPU.
"""

import ctypes
import threading

from amem_callbacks.tools.progress import REPEATS, progress_during, transition_progress

LIBC_CALLS, CALL_US = 8, 60_000  # 8 calls of 60 ms: like one NCCL call per communicator


def _in_thread(libc):
    def calls():
        for _ in range(LIBC_CALLS):
            libc.usleep(CALL_US)

    def start():
        worker = threading.Thread(target=calls, daemon=True)
        worker.start()
        return worker
    return start


def _ratio(libc) -> float:
    measured = progress_during(_in_thread(libc), lambda worker: worker.is_alive(),
                               baseline_s=0.3)
    measured["handle"].join()
    assert measured["slices"] >= 1, measured
    return measured["ratio"]


def test_a_call_that_releases_the_gil_leaves_the_caller_its_pace():
    # median of three: a 2-core CI machine runs other work beside this test
    ratios = sorted(_ratio(ctypes.CDLL(None)) for _ in range(3))
    assert ratios[1] >= 0.5, ratios


def test_a_call_that_holds_the_gil_stops_the_caller():
    ratios = sorted(_ratio(ctypes.PyDLL(None)) for _ in range(3))
    assert ratios[1] < 0.25, ratios


class _Report:
    def __init__(self, worker):
        self.worker, self.wall_seconds, self.gil_held = worker, 0.5, False
        self.groups = []

    @property
    def pending(self):
        return self.worker.is_alive()


class _Policy:
    """An overlapped policy whose transitions are libc calls in a worker thread."""

    def __init__(self, libc):
        self.start, self.calls, self.last = _in_thread(libc), [], None

    def begin(self, phase):
        self.calls.append(("begin", phase))
        self.last = _Report(self.start())
        return self.last

    def end(self, phase):
        self.calls.append(("end", phase))
        self.last = _Report(self.start())
        return self.last

    def wait(self):
        self.last.worker.join()


def test_the_transition_progress_is_the_median_of_three_cycles_and_lists_each():
    policy, barriers = _Policy(ctypes.PyDLL(None)), []
    out = transition_progress(policy, lambda: barriers.append(1))
    assert policy.calls == [("begin", "rollout"), ("end", "rollout")] * REPEATS
    assert len(barriers) == 2 * REPEATS  # the ranks line up before every transition
    for kind in ("begin", "end"):
        runs = out[kind]["runs"]
        assert len(runs) == REPEATS and out[kind]["first_ratio"] == runs[0]["ratio"]
        assert out[kind]["ratio"] == sorted(r["ratio"] for r in runs)[1]
        assert out[kind]["ratio"] < 0.25  # a call that holds the GIL, every cycle
