"""Learned keep-sets on gloo ranks with the fake NCCL: a group the guard had to
resume during a phase stays active in that phase from the next begin on."""

from tests.harness import run_ranks


def phases(**args):
    results = run_ranks("learn_keep", world=2, timeout=120, args=args)
    return [r["result"] for r in results]


def test_learned_on_every_rank_keeps_the_group_from_the_next_phase_on():
    for res in phases(phases=3):
        first, second, third = res["phases"]
        assert first["dp"][0] == "suspended" and first["auto_resumes"] == 1
        assert first["learned"] == {"dp": 1}
        for later in (second, third):
            assert later["dp"] == ["kept", "learned: the guard resumed it 1 time(s) during "
                                           "phase 'rollout'"]
        assert third["auto_resumes"] == 1  # no new guard resume after the first phase
        assert second["dp_suspended_by_fake"] == third["dp_suspended_by_fake"] == 1
        assert all(p["exact"] for p in res["phases"])
        assert res["metrics"] == {"amem/learned/rollout/dp": 1}


def test_learned_on_one_rank_only_is_kept_everywhere_by_the_agreement():
    results = phases(phases=2, learn=[True, False], touch_phases=[0])
    for res in results:
        second = res["phases"][1]
        assert second["dp"][0] == "kept" and second["exact"]
    assert results[0]["phases"][1]["dp"][1].startswith("learned")
    assert results[1]["phases"][1]["dp"][1].startswith("a peer rank refused: rank 0: learned")


def test_learning_off_resumes_by_the_guard_every_phase():
    for res in phases(phases=3, learn=[False, False]):
        assert [p["dp"][0] for p in res["phases"]] == ["suspended"] * 3
        assert res["phases"][2]["auto_resumes"] == 3 and res["metrics"] == {}  # one per phase
        assert all(p["exact"] for p in res["phases"])


def test_strict_guard_raises_and_learns_nothing():
    for res in phases(phases=2, guard="strict", touch_phases=[0]):
        first, second = res["phases"]
        assert first["raised"] == "SuspendedGroupError" and second["dp"][0] == "suspended"
        assert res["metrics"] == {}


def test_forget_learned_suspends_the_group_again_and_keep_still_wins():
    for res in phases(phases=3, touch_phases=[0], forget_after=2):
        assert [p["dp"][0] for p in res["phases"]] == ["suspended", "kept", "suspended"]
        assert all(p["exact"] for p in res["phases"])


def test_keep_given_by_the_user_wins_and_nothing_is_learned_for_it():
    for res in phases(phases=2, keep=["tp", "dp"]):
        assert [p["dp"] for p in res["phases"]] == [["kept", "kept active for phase 'rollout'"]] * 2
        assert [p["ep"] for p in res["phases"]] == ["suspended", "suspended"]
        assert res["phases"][1]["auto_resumes"] == 0 and res["metrics"] == {}
