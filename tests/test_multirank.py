"""Policy behaviour across real ranks (gloo) with a fake NCCL behind each group."""

import pytest

from tests.harness import run_ranks


def results(scenario, world=2, **args):
    return [r["result"] for r in run_ranks(scenario, world=world, args=args)]


def test_discovery_keys_and_names_agree_across_ranks():
    r0, r1 = results("discovery")
    assert r0["groups"] == r1["groups"]
    names = [g[1] for g in r0["groups"]]
    assert names == ["world", "dp", "tp", "ep"]
    assert all(g[2] == [0, 1] for g in r0["groups"])


def test_cycle_suspends_idle_groups_keeps_the_rest_and_restores_exactly():
    for res in results("fake_cycle", cycles=3):
        assert len(res["cycles"]) == 3
        for cycle in res["cycles"]:
            begin = cycle["begin"]["groups"]
            assert begin["world"][0] == begin["dp"][0] == "suspended"
            assert begin["tp"] == ["kept", "kept active for phase 'rollout'", None]
            assert begin["ep"][0] == "kept" and "min_bytes" in begin["ep"][1]
            assert cycle["during"] == {"dp": True, "ep": False, "tp": False, "world": True}
            assert cycle["after"] == {"dp": False, "ep": False, "tp": False, "world": False}
            assert cycle["kept_ok"] and cycle["exact"]
            assert cycle["begin"]["nccl_bytes"] == 2 * 480 * 2**20
            assert cycle["begin"]["flat"]["amem/begin/groups_suspended"] == 2
            assert cycle["end"]["flat"]["amem/end/groups_resumed"] == 2
        assert res["counts"]["dp"] == [3, 3] and res["counts"]["ep"] == [0, 0]
        assert res["counters"]["amem/total/begins"] == 3
        assert res["counters"]["amem/total/group_suspends"] == 6


@pytest.mark.parametrize("world", [2, 3])
def test_guard_resumes_a_suspended_group_before_a_call_on_it(world):
    for rank, res in enumerate(results("guard", world=world)):
        assert all(res["suspended_before"].values())
        assert res["dp_exact"] and res["dp_suspended_after_call"] is False
        assert res["barrier_ok"] and res["exact_after"]
        groups = res["end"]["groups"]
        assert "allreduce" in groups["dp"][1] and "barrier" in groups["world"][1]
        if rank == 1:
            assert res["p2p_value"] == [7.0] * 4
        if rank < 2:
            assert "pair" in groups and "resumed by the guard" in groups["pair"][1]
        if world > 2 and rank < 2:
            assert "cannot be resumed here safely" in res["p2p_big_group_error"]
        assert not any(res["after"].values())
        expected_auto = 3 if rank < 2 else 2  # dp, world, and the 2-rank pair
        assert res["auto_resumes"] == expected_auto


def test_strict_guard_raises_with_the_fix_and_leaves_the_group_suspended():
    for res in results("guard", mode="strict"):
        assert "guard='strict'" in res["dp_error"] and "keep=" in res["dp_error"]
        assert "p2p_error" in res and "barrier_error" in res
        assert all(g[0] == "resumed" for g in res["end"]["groups"].values())
        assert res["exact_after"]


def test_different_keep_sets_leave_the_disputed_groups_active():
    r0, r1 = results("disagree")
    for res in (r0, r1):
        assert res["during"] == {"dp": True, "ep": False, "tp": False, "world": True}
        assert res["exact_during"] and res["exact_after"]
    assert "peer rank refused" in r0["begin"]["groups"]["ep"][1]
    assert "peer rank refused" in r1["begin"]["groups"]["tp"][1]


def test_a_group_missing_on_one_rank_is_kept_within_the_timeout():
    r0, r1 = results("disagree", missing_group=True, agree_timeout_s=2)
    assert "did not reach" in r0["begin"]["groups"]["dp"][1]
    assert r0["during"]["dp"] is False and "dp" not in r1["during"]
    for res in (r0, r1):
        assert res["took"] < 2 * 2 + 2, "agreement must be bounded by ~2x the timeout"
        assert res["exact_during"] and res["exact_after"]


def test_a_late_rank_gets_the_same_keep_decision_and_the_next_cycle_works():
    r0, r1 = results("late_rank", agree_timeout_s=2)
    for res in (r0, r1):
        assert not any(res["during"].values())
        assert all(g[0] == "kept" for g in res["begin"]["groups"].values())
        assert all(res["during2"].values()), "the next cycle must suspend again"
        assert res["exact"]
    assert r0["took"] < 2 * 2 + 2


def test_a_suspend_that_fails_part_way_on_one_rank_breaks_the_group_everywhere_without_a_wait():
    """NCCL has no rollback: past its members' barrier, a failed suspend leaves the
    communicator partly offloaded and a resume refuses it (mem_manager.cc). The rank
    that suspended must not resume alone (NCCL would wait for the failed one forever):
    the group is broken on both ranks, calls on it raise, the other groups carry on,
    and it is never planned again. With the fake's members waiting for each other."""
    r0, r1 = results("inject", op="suspend", group="dp", peers=True)
    assert "ncclCommSuspend failed" in r0["begin"]["groups"]["dp"][2]
    assert "rank(s) [0] failed to suspend it part-way" in r1["begin"]["groups"]["dp"][2]
    assert r0["partial"] and not r1["partial"]
    assert r0["during"]["dp"] is False and r1["during"]["dp"] is True  # kept suspended there
    for res in (r0, r1):
        assert res["begin"]["groups"]["dp"][0] == "failed"
        assert res["resumes"] == 0 and not res["peer_timed_out"] and res["took"] < 15
        assert {k: v for k, v in res["during"].items() if k != "dp"} == {
            "ep": True, "tp": True, "world": True}
        for collectives in (res["collectives"], res["collectives_second"]):
            assert "Restart the job" in collectives["dp"]
            assert all(collectives[g] is True for g in ("ep", "tp", "world"))
        assert res["second"]["groups"]["dp"][0] == "kept"
        assert "broken since" in res["second"]["groups"]["dp"][1]
        assert res["second"]["groups"]["tp"][0] == "suspended"


def test_a_usage_error_on_every_rank_leaves_the_group_active_everywhere():
    """NCCL's usage errors come from its checks, before the members meet: nothing
    changed, so the group stays active on every rank and the next cycle suspends it."""
    r0, r1 = results("inject", op="suspend", group="dp", peers=True, code=5, on_ranks=[0, 1])
    for res in (r0, r1):
        assert "ncclCommSuspend failed" in res["begin"]["groups"]["dp"][2]
        assert not res["partial"] and not res["peer_timed_out"]
        assert res["during"] == {"dp": False, "ep": True, "tp": True, "world": True}
        assert not any(res["after"].values())
        assert res["exact_after"] and res["exact_second"]
        assert res["second"]["groups"]["dp"][0] == "suspended"


def test_one_resume_error_is_retried():
    """NCCL's resume fails before its members meet: the retry on the failing rank is
    the call the waiting member needs (the fake's members wait for each other here)."""
    for res in results("inject", op="resume", group="dp", peers=True):
        assert not any(res["after"].values()) and res["exact_after"]
        assert not res["peer_timed_out"]


def test_a_group_that_cannot_be_resumed_raises_on_every_rank_instead_of_hanging():
    """Without the fake's member wait: on real NCCL the rank that resumed would wait in
    its resume for the one that failed twice (NCCL's barrier has no timeout)."""
    r0, r1 = results("inject", op="resume", group="dp", times=2)
    assert "resume failed twice" in r0["collectives"]["dp"]
    assert "rank(s) [0] could not resume it" in r1["collectives"]["dp"]
    for res in (r0, r1):
        assert "broken since" in res["second"]["groups"]["dp"][1]
        assert "failed" in res["collectives_second"]["dp"]  # raises again, never hangs


def test_ranks_with_different_backends_all_run_unchanged():
    for res in results("backend_mismatch"):
        assert res["inert"] and res["begin"]["skipped"]
        assert not any(res["during"].values()) and res["exact"]


def test_noop_reports_what_it_would_do():
    for res in results("noop_dry_run"):
        groups = res["begin"]["groups"]
        assert groups["dp"][0] == "would suspend" and groups["tp"][0] == "kept"
        assert res["begin"]["nccl_bytes"] == 0 and res["exact"] and res["auto_resumes"] == 1


def test_amem_pauses_the_whole_process_once_and_guards_subgroups():
    for rank, res in enumerate(results("amem_fake", world=3)):
        assert res["paused_during"] == 1 and res["paused_after"] == 0 and res["pauses"] == 1
        if rank < 2:
            assert "only a call on the default group" in res["subgroup_error"]
        assert res["world_sized_ok"] and res["paused_after_guard"] == 0
        assert res["end"]["groups"]["process"][0] == "resumed"
        assert res["exact"]


def test_amem_refuses_when_a_group_must_stay_active():
    for res in results("amem_fake", keep=["tp"]):
        assert res["paused_during"] == 0 and res["tp_ok"] and res["exact"]
        assert "cannot keep ['tp'] active" in res["begin"]["groups"]["dp"][1]


def test_lifecycle_corner_cases():
    for res in results("lifecycle"):
        assert res["end_without_begin"] == "no phase is active"
        assert res["second_begin"] == "phase 'rollout' is already active"
        assert "call end('rollout')" in res["wrong_end"]
        assert all(res["during"].values()) and not any(res["after"].values())
        assert all(res["ctx_during"].values()) and not any(res["ctx_after"].values())
        # the body raised: groups stay suspended, the phase is over, the guard resumes on use
        assert res["after_exception_open"] is False and all(res["after_exception"].values())
        assert res["exact"] and res["auto_resumes"] == 4 and not any(res["after_guard"].values())


def test_device_mesh_groups_are_named_by_dimension_and_kept_by_it():
    for res in results("device_mesh", world=4):
        groups = res["begin"]["groups"]
        assert groups["mesh_tp"][0] == "kept" and groups["mesh_dp"][0] == "suspended"
        assert groups["world"][0] == "suspended" and res["tp_ok"]


@pytest.mark.parametrize("seed, workers, overlap", [(0, 1, True), (1, 3, True), (2, 2, False),
                                                    (3, 1, True), (4, 4, True)])
def test_random_interleavings_never_reach_a_suspended_communicator(seed, workers, overlap):
    for res in results("interleave", seed=seed, workers=workers, overlap=overlap):
        assert res["violations"] == [], res["actions"]
        assert res["exact"] and res["failures"] == 0
        assert not any(res["left_suspended"].values())
        assert "begin" in res["actions"]


def test_a_later_policy_agrees_afresh_and_never_reads_an_earlier_ones_decision():
    results = run_ranks("policies_in_sequence", world=2, timeout=120)
    for r in results:
        first, _second, last = r["result"]["rows"]
        assert first["dp"] == "suspended" and first["exact"]
        assert last["dp"] == "kept" and last["world"] == "suspended" and last["exact"]
