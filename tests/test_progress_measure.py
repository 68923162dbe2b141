"""tools/progress.py tells a call that holds the GIL from one that releases it.

The same C function (libc's usleep) called through ctypes.PyDLL keeps the GIL
for the whole call, through ctypes.CDLL it lets it go: the two sides of the
rule "no call into NCCL may hold the GIL", on CPU.
"""

import ctypes
import threading

from amem_callbacks.tools.progress import REPEATS, progress_during, slow_c_calls, \
    transition_progress, transition_suspects

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


class _BuiltinPolicy(_Policy):
    """Its transitions run a builtin that holds the GIL (``sum`` over a long range):
    what a torch method bound without a GIL release looks like to the profiler."""

    def __init__(self):
        def start():
            worker = threading.Thread(target=lambda: sum(range(3_000_000)), daemon=True)
            worker.start()
            return worker
        self.start, self.calls, self.last = start, [], None


def test_the_suspects_name_a_builtin_that_held_the_gil_and_never_a_ctypes_call():
    held = transition_suspects(_BuiltinPolicy(), lambda: None)
    for kind in ("begin", "end"):
        names = [name for _took, name, _thread in held[kind]["calls"]]
        assert "sum" in names, held
    released = transition_suspects(_Policy(ctypes.CDLL(None)), lambda: None)
    assert released["begin"]["calls"] == [] and released["end"]["calls"] == [], released


def test_the_suspects_leave_out_waits_and_short_calls():
    def run():
        threading.Event().wait(0.05)  # a wait: the GIL is released while it lasts
        len("short")
    assert slow_c_calls(run)["calls"] == []
