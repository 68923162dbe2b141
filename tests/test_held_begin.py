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
