"""A begin that holds its suspends (``begin(hold_s=...)``, ``start_suspends``):
what starts them, what they report, and that the agreement stays in step
(tests/scenarios_held.py, two gloo ranks, the fake NCCL)."""

import math

import pytest

from amem_callbacks import OffloadPolicy, RolloutSession
from amem_callbacks.errors import OptionError
from tests.harness import run_ranks

SUSPENDED_ON_A_CYCLE = {"dp": [1, 1], "ep": [1, 1], "world": [1, 1]}


def results(name, **args):
    return [r["result"] for r in run_ranks(f"tests.scenarios_held:{name}", world=2,
                                           timeout=120, args=args)]


def test_held_suspends_start_when_each_rank_lets_them_go():
    for rank, res in enumerate(results("started_by_each_rank")):
        before = res["before"]
        assert not any(before["suspended"].values()), before  # 0.3 s on: still held
        assert all(c == [0, 0] for c in before["counts"].values())
        assert before["pending"] and not before["freed"]
        assert "holding (up to 30 s" in res["summary_while_held"]
        assert res["kept_ok"] and res["started"] and not res["again"]
        assert res["caller_back_s"] < 0.1
        assert 0 <= res["suspended_after_s"] < 5
        if rank == 0:  # its suspends waited in the background for rank 1's, 0.5 s later
            assert res["suspended_after_s"] >= 0.3
        assert res["held_seconds"] >= 0.3 + 0.5 * rank
        assert res["flat"]["amem/begin/held_seconds"] == res["held_seconds"]
        assert "held" in res["summary"]
        assert res["begin"] == {"dp": "suspended", "ep": "suspended", "tp": "kept",
                                "world": "suspended"}
        assert set(res["end"]) == {"dp", "ep", "world"}
        assert not any(res["after"].values())
        assert res["counts"] == dict(SUSPENDED_ON_A_CYCLE, tp=[0, 0]) and res["exact"]


@pytest.mark.parametrize("how", ["end", "wait", "guard", "memory", "bound"])
def test_what_needs_held_suspends_starts_them(how):
    for res in results("started_by_what_needs_them", how=how):
        assert res["held_early"], res
        assert res["counts"] == dict(SUSPENDED_ON_A_CYCLE, tp=[0, 0]), res
        assert not any(res["after"].values()) and res["exact"]
        assert res["held_seconds"] >= 0.2
        assert res["seconds"] < 10  # started by it, not by the 30 s bound
        if how == "wait":
            assert res["during"] == {"dp": True, "ep": True, "tp": False, "world": True}
        if how == "guard":
            assert res["dp_ok"] and res["auto_resumes"] == 1 and res["dp_view"] is None
            # the call waited for dp's suspend and its resume, and the figures say so
            assert res["guard_waits"]["amem/guard_wait/dp/calls"] >= 1
            assert set(res["guard_waits"]) == {"amem/guard_wait/dp/calls",
                                               "amem/guard_wait/dp/seconds"}
        if how == "memory":
            assert res["freed"] > 0
        if how == "bound":
            assert 0 <= res["suspended_after_s"] < 5 and 0.4 <= res["held_seconds"] < 3


def test_held_begins_keep_every_agreement_round_in_step():
    ranks = results("held_then_cycles")
    assert ranks[0]["rows"] == ranks[1]["rows"]
    for row in ranks[0]["rows"]:
        assert row == {"suspended": ["dp", "ep", "world"], "resumed": ["dp", "ep", "world"],
                       "exact": True}
    assert ranks[0]["counts"]["dp"] == [4, 4]


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, "1", True])
def test_a_bad_hold_fails_at_the_call_saying_what_to_write(bad):
    policy = OffloadPolicy(backend="noop")
    with pytest.raises(OptionError, match="hold_s"):
        policy.begin("rollout", hold_s=bad)
    assert policy.metrics() == {} or not policy.metrics().get("amem/total/begins")


def test_a_start_that_holds_cannot_also_wait_for_the_memory():
    session = RolloutSession(OffloadPolicy(backend="noop"))
    for need in (None, 1):
        with pytest.raises(OptionError, match="need_bytes=0"):
            session.start("generate", need_bytes=need, hold_s=1.0)
    assert not session.active and not session.start_suspends()


MIB = 2**20
GROUP_BYTES = 480 * MIB  # tests.scenarios.FakeNccl's default size per communicator


@pytest.mark.parametrize("case", ["fits", "lacks", "unknown"])
def test_a_start_told_what_comes_next_waits_only_for_what_the_free_memory_lacks(case):
    """TRL's colocated vLLM: the begin before its KV wake-up waits for the suspends
    only where the free memory cannot hold what vLLM maps next."""
    from amem_callbacks.headroom import DEFAULT_MARGIN_BYTES

    allocating = 100 * MIB
    free = {"fits": 64 * 2**30, "lacks": 0, "unknown": None}[case]
    for res in results("allocating", free=free, allocating=allocating):
        assert res["counts"] == SUSPENDED_ON_A_CYCLE | {"tp": [0, 0]}, res
        assert not any(res["after"].values()) and res["exact"]
        if case == "fits":  # returned at once, the suspends (0.3-0.9 s) still running
            assert res["waited_for_bytes"] == 0 and res["pending_at_return"], res
            assert not any(res["suspended_at_return"].values())
            assert res["flat"]["amem/begin/waited_for_bytes"] == 0
        elif case == "lacks":  # 612 MiB: world's and dp's 960 MiB (0.6 s), not ep's (0.9 s)
            need = allocating + DEFAULT_MARGIN_BYTES
            assert res["waited_for_bytes"] == need and res["pending_at_return"], res
            assert res["freed_at_return"] == 2 * GROUP_BYTES
            assert res["suspended_at_return"] == {"dp": True, "ep": False, "tp": False,
                                                  "world": True}
        else:  # no reading: the whole begin, as without the argument
            assert res["waited_for_bytes"] is None and not res["pending_at_return"]
            assert res["freed_at_return"] == 3 * GROUP_BYTES
            assert res["suspended_at_return"] == {"dp": True, "ep": True, "tp": False,
                                                  "world": True}


@pytest.mark.parametrize("kwargs,match", [
    ({"allocating_bytes": -1}, "allocating_bytes"),
    ({"allocating_bytes": 1.5}, "allocating_bytes"),
    ({"allocating_bytes": 1, "need_bytes": 0}, "drop need_bytes"),
    ({"allocating_bytes": 1, "margin_bytes": -1}, "margin_bytes"),
    ({"allocating_bytes": 1, "margin_bytes": "256M"}, "margin_bytes"),
])
def test_a_bad_allocating_start_fails_at_the_call_saying_what_to_write(kwargs, match):
    session = RolloutSession(OffloadPolicy(backend="noop"))
    with pytest.raises(OptionError, match=match):
        session.start("generate", **kwargs)
    assert not session.active


def test_what_a_begin_lacks_is_this_ranks_part_of_the_free_memory_less_the_margin():
    from amem_callbacks.session import lacking_bytes

    assert lacking_bytes(100, None) is None
    assert lacking_bytes(100, 1000, margin=0) == 0
    assert lacking_bytes(100, 1000, shared_by=2, margin=450) == 50  # 500 each, 550 needed
    assert lacking_bytes(0, 0, margin=10) == 10


@pytest.mark.parametrize("second", [[64 * 2**30, 64 * 2**30], [64 * 2**30, 0],
                                    [None, 64 * 2**30]])
def test_a_begin_no_rank_needs_is_skipped_by_every_rank_and_one_any_rank_needs_runs_on_all(
        second):
    """After the first begin, a phase whose next allocation fits on every rank
    suspends nothing (its resume would cost the next step for nothing); one rank
    lacking, or not knowing, makes every rank begin: the same decision everywhere."""
    skip = all(f is not None and f > 2**30 for f in second)
    for res in results("allocating_twice", second=second):
        assert res["first_skipped"] is None  # the first always runs
        assert res["exact"] and not any(res["after"].values())
        if skip:
            assert res["second_skipped"].startswith("not needed") and not res["active"]
            assert res["second_waited"] == 0 and not res["stop"]
            assert res["counts"] == {"dp": [1, 1], "ep": [1, 1], "tp": [0, 0], "world": [1, 1]}
            assert res["not_needed"] == 1
        else:
            assert res["second_skipped"] is None and res["stop"]
            assert res["counts"] == {"dp": [2, 2], "ep": [2, 2], "tp": [0, 0], "world": [2, 2]}
            assert res["not_needed"] == 0
