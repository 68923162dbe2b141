"""FSDP2 with forward prefetch (verl's FSDP2 engine, TRL's FSDP2 and HSDP): no
collective reaches a suspended communicator, and training is exactly as without
the package, when the training step starts while the resumes still run.

4 gloo ranks as HSDP (2 replicas x 2 shards), a fake NCCL behind every group,
and the tripwire that ends a rank whose collective reaches a suspended one.
"""

from tests.harness import run_ranks

SCENARIO = "tests.scenarios_fsdp2:fsdp2_rollouts"


def _run(**args):
    return [r["result"] for r in run_ranks(SCENARIO, world=4, timeout=240, args=args)]


def test_an_idle_rollout_suspends_every_group_and_training_waits_for_each():
    """verl's case: the training worker is idle while the servers generate."""
    for res in _run(steps=3, generate=False):
        assert res["losses"] == res["baseline"] and res["weights_equal"]
        for during in res["suspended_during"]:
            assert during and all(during.values()), during  # world, dp_replicate, dp_shard
        assert not any(res["suspended_after"].values())
        # FSDP2's first all-gather met a group still resuming: the guard held it back
        assert res["guard_wait_seconds"] > 0
        assert res["auto_resumes"] == 0  # every group was resumed by end(), none by the guard
        assert res["group_suspends"] == res["group_resumes"] == 3 * len(res["suspended_during"][0])


def test_a_rollout_that_runs_the_sharded_model_keeps_the_groups_it_gathers_over():
    """TRL's transformers generation with HSDP: the shard dim is kept (the no-grad
    forwards gather over it, prefetch included); the replicate dim and the
    default group are suspended."""
    for res in _run(steps=3, generate=True):
        assert res["keep"] == ["dp_shard"]
        assert res["losses"] == res["baseline"] and res["weights_equal"]
        for during in res["suspended_during"]:
            assert during.get("dp_shard") in (None, False), during
            assert during["dp_replicate"] and during["world"], during
        assert res["auto_resumes"] == 0


def test_the_scenario_turns_red_when_the_guard_lets_a_call_through():
    """Mutation: with the guard letting every call through, FSDP2's first gather
    of the training step reaches a communicator still suspended, and the tripwire
    ends that rank, as real NCCL would."""
    from tests.fake_nccl.tripwire import EXIT_CODE, MARKER
    from tests.mutations import ENV

    ranks = run_ranks(SCENARIO, world=4, timeout=240, args={"steps": 2},
                      env={ENV: "guard-off"}, expect_ok=False, allow_fake_nccl_fatal=True)
    killed = [r for r in ranks if r["fake_nccl_fatal"]]
    assert killed and all(r["returncode"] == EXIT_CODE for r in killed)
    for r in killed:  # FSDP2's parameter all-gather (torch 2.13: _allgather_base_) on the shard group
        [line] = r["fake_nccl_fatal"]
        assert line.startswith(f"{MARKER}: c10d::") and "gather" in line \
            and " on group 'dp_shard' " in line, line
    assert not any("result" in r for r in ranks)
