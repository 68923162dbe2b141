"""Store agreement with threads standing in for ranks: consistent and bounded."""

import threading
import time

import torch.distributed as dist

from amem_callbacks.agreement import Agreement, verdict_of, vote_keep, vote_suspend
from amem_callbacks.states import Verdict


def run(votes: dict, members=(0, 1, 2), timeout=1.0, delays=None, key="g"):
    store = dist.HashStore()
    results, took = {}, {}

    def rank(r):
        time.sleep((delays or {}).get(r, 0))
        start = time.monotonic()
        agreement = Agreement(store, r, timeout)
        results[r] = agreement.decide({key: (members, votes[r])})[key]
        took[r] = time.monotonic() - start

    threads = [threading.Thread(target=rank, args=(r,)) for r in votes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "agreement must never block past its bound"
    return results, took


def test_all_yes_suspends_everywhere():
    results, _ = run({r: vote_suspend("nccl") for r in range(3)})
    assert all((verdict_of(v) is Verdict.SUSPEND) for v in results.values()) and len(set(results.values())) == 1


def test_one_refusal_keeps_the_group_on_every_member_and_says_why():
    results, _ = run({0: vote_suspend("nccl"), 1: vote_keep("kept for phase"), 2: vote_suspend("nccl")})
    assert len(set(results.values())) == 1
    assert verdict_of(results[0]) is Verdict.KEEP and "rank 1: kept for phase" in results[0]


def test_different_backends_keep_the_group():
    results, _ = run({0: vote_suspend("nccl"), 1: vote_suspend("amem"), 2: vote_suspend("nccl")})
    assert "different backends" in results[2]


def test_missing_member_is_detected_within_the_bound():
    results, took = run({0: vote_suspend("nccl"), 1: vote_suspend("nccl")}, timeout=0.5)
    assert "rank(s) [2] did not reach" in results[0] and results[0] == results[1]
    assert max(took.values()) < 2 * 0.5 + 0.5


def test_late_leader_and_early_members_still_agree():
    results, took = run({r: vote_suspend("nccl") for r in range(3)}, timeout=0.3, delays={0: 1.0})
    assert len(set(results.values())) == 1 and verdict_of(results[1]) is Verdict.KEEP
    assert "leader rank 0 did not decide" in results[1]


def test_rounds_are_independent_and_old_keys_are_dropped():
    store = dist.HashStore()
    agreements = [Agreement(store, r, 1.0) for r in (0, 1)]
    for round_no in range(4):
        out = {}
        threads = [threading.Thread(target=lambda a=a: out.__setitem__(
            a.rank, a.decide({"g": ((0, 1), vote_suspend("nccl") if round_no % 2 else vote_keep("x"))})))
            for a in agreements]
        [t.start() for t in threads]
        [t.join(10) for t in threads]
        assert (verdict_of(out[0]["g"]) is Verdict.SUSPEND) == bool(round_no % 2) and out[0] == out[1]
    assert not store.check(["amem_callbacks/plan/g/0/decision"])
    assert store.check(["amem_callbacks/plan/g/3/decision"])


def test_exchange_reports_missing_ranks_as_none():
    store = dist.HashStore()
    got = Agreement(store, 0, 0.2).exchange({"g": ((0, 1), "ok")})
    assert got == {"g": {0: "ok", 1: None}}


def test_a_member_arriving_after_its_peers_gave_up_reads_itself_missing_like_them():
    """The exchange is sealed: a late rank sees the same set its peers acted on."""
    store = dist.HashStore()
    results = {}

    def rank(r, delay):
        time.sleep(delay)
        results[r] = Agreement(store, r, 0.3).exchange({"g": ((0, 1, 2), f"v{r}")})["g"]

    threads = [threading.Thread(target=rank, args=(r, 1.0 if r == 2 else 0)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results[0] == results[1] == {0: "v0", 1: "v1", 2: None}
    assert results[2] == results[0]  # late: not {0: v0, 1: v1, 2: v2}, which nobody else saw


def test_an_exchange_on_time_gives_every_value_to_everyone():
    store = dist.HashStore()
    results = {}

    def rank(r):
        results[r] = Agreement(store, r, 5.0).exchange({"g": ((0, 1), f"v{r}")})["g"]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results[0] == results[1] == {0: "v0", 1: "v1"}


def test_share_splits_values_from_missing_ranks_in_any_member_order():
    """An adapter's own round (RolloutSession.store_exchange/store_barrier)."""
    store = dist.HashStore()
    results = {}

    def rank(r):
        results[r] = Agreement(store, r, 0.5).share("sizes", f"v{r}", [1, 0, 2])

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results[0] == results[1] == ({0: "v0", 1: "v1"}, [2])
    assert store.check(["amem_callbacks/outcome/__exchange__/sizes/0/0"])


def test_two_threads_of_each_rank_in_rounds_of_their_own_never_wait_for_each_other():
    """Two ranks, each a TCPStore client (as torch's default group has) used by two
    threads: an overlapped begin's outcome round and the KV growth's round, started in
    the order that once stalled both for the whole timeout (CI, 2026-12-03): rank 1's
    growth round and rank 0's begin round first, each waiting for a slot its peer's
    other thread writes next. A store.wait held the client for the whole wait, so the
    second writes queued behind it; every round must end long before the timeout."""
    from datetime import timedelta

    from amem_callbacks.tools.launch import free_port

    timeout = 20.0
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=60),
                           wait_for_workers=False)
    stores = {0: server, 1: dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))}
    agreements = {r: Agreement(stores[r], r, timeout) for r in (0, 1)}
    results, took = {}, {}

    def growth(r):
        start = time.monotonic()
        results[("growth", r)] = agreements[r].share("kv_cache/ready", f"g{r}", [0, 1])
        took[("growth", r)] = time.monotonic() - start

    def begin(r):
        start = time.monotonic()
        results[("begin", r)] = agreements[r].exchange({"31": ((0, 1), f"b{r}")})["31"]
        took[("begin", r)] = time.monotonic() - start

    first = [threading.Thread(target=growth, args=(1,)), threading.Thread(target=begin, args=(0,))]
    second = [threading.Thread(target=begin, args=(1,)), threading.Thread(target=growth, args=(0,))]
    for t in first:
        t.start()
    time.sleep(0.3)  # the first two are waiting now, each for a slot not yet written
    for t in second:
        t.start()
    for t in first + second:
        t.join(3 * timeout)
    assert results[("growth", 0)] == results[("growth", 1)] == ({0: "g0", 1: "g1"}, [])
    assert results[("begin", 0)] == results[("begin", 1)] == {0: "b0", 1: "b1"}
    # a liveness bound, not a speed figure: stalled, each took the whole timeout
    assert max(took.values()) < timeout / 2, took
