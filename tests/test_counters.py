"""Counters are written from the caller's thread and the transition pool at once
(NCCL calls release the GIL): no count may be lost."""

import sys
import threading

from amem_callbacks.report import Counters

THREADS, ADDS = 8, 20_000


def _hammer(counters: Counters) -> None:
    start = threading.Barrier(THREADS)

    def work():
        start.wait()
        for _ in range(ADDS):
            counters.add("group_suspends")
            counters.add("guard_wait_seconds", 0.5)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    try:
        threads = [threading.Thread(target=work) for _ in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old)


def test_no_count_is_lost_when_threads_add_at_once():
    counters = Counters()
    _hammer(counters)
    assert counters.group_suspends == THREADS * ADDS
    assert counters.guard_wait_seconds == THREADS * ADDS * 0.5


def test_the_same_hammer_loses_counts_without_the_lock():
    """The test above can fail: an add that is a bare ``+=`` loses counts."""

    class Unlocked(Counters):
        def add(self, name, amount=1):
            value = getattr(self, name)
            for _ in range(20):  # widen the read-modify-write window a little
                pass
            setattr(self, name, value + amount)

    counters = Unlocked()
    _hammer(counters)
    assert counters.group_suspends < THREADS * ADDS


def test_the_figures_read_out_without_the_lock_field():
    counters = Counters()
    counters.add("begins")
    counters.record_freed(5)
    counters.record_freed(3)
    out = counters.as_dict()
    assert out["amem/total/begins"] == 1
    assert out["amem/total/last_device_freed_bytes"] == 3
    assert out["amem/total/max_device_freed_bytes"] == 5
    assert not any("lock" in key for key in out)


# --- the bound of a transition: the group's own c10d timeout ---------------------------
def test_a_group_timeout_is_read_and_a_renamed_field_warns_once(caplog):
    import datetime
    import types

    from amem_callbacks import group_book

    def group(options):
        backend = types.SimpleNamespace(options=options)
        return types.SimpleNamespace(_get_backend=lambda device: backend)

    assert group_book.group_timeout_s(group(types.SimpleNamespace(
        _timeout=datetime.timedelta(seconds=42)))) == 42
    group_book._warned_timeout.clear()
    renamed = group(types.SimpleNamespace(timeout=datetime.timedelta(seconds=42)))
    with caplog.at_level("WARNING", logger="amem_callbacks"):
        assert group_book.group_timeout_s(renamed) == group_book.FALLBACK_TIMEOUT_S
        assert group_book.group_timeout_s(renamed) == group_book.FALLBACK_TIMEOUT_S
    lines = [r.getMessage() for r in caplog.records if "c10d timeout" in r.getMessage()]
    assert len(lines) == 1 and "Set timeout_s=" in lines[0]


def test_guard_waits_are_counted_per_group_and_summed():
    counters = Counters()
    for name, seconds in (("dp", 0.25), ("world", 0.5), ("dp", 0.125)):
        counters.record_guard_wait(name, seconds)
    flat = counters.as_dict()
    assert flat["amem/total/guard_wait_seconds"] == 0.875
    assert (flat["amem/guard_wait/dp/calls"], flat["amem/guard_wait/dp/seconds"]) == (2, 0.375)
    assert (flat["amem/guard_wait/world/calls"], flat["amem/guard_wait/world/seconds"]) == (1, 0.5)
