"""Megatron adapter: the flags, parallel_state roles, and the hooks on the real
DynamicInferenceEngine class (megatron-core 0.16.1), 2 ranks on gloo, fake NCCL."""

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.harness import ROOT, free_port, run_ranks

# find_spec, not importorskip: importing megatron.core here would cost seconds
# in the pytest process; the scenarios import it in their own processes.
# find_spec("megatron.core") raises, not returns None, when "megatron" itself is missing.
if importlib.util.find_spec("megatron") is None or \
        importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed: pip install 'amem-callbacks[megatron]'",
                allow_module_level=True)

SCENARIOS = "tests.scenarios_megatron"
KEPT_IN_PLACE = {"tp", "pp", "mp", "ep", "expert_tp", "tp_ep", "tp_ep_pp", "tp_cp", "embd",
                 "pos_embd"}
IDLE_IN_PLACE = {"world", "dp", "dp_cp", "cp", "tp_dp", "tp_dp_cp", "expert_dp", "intra_dist_opt"}

# An RL command line as Megatron-LM's examples write it, plus the new flags.
RL_COMMAND = ("--perform-rl-step --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
              "--grpo-group-size 8 --grpo-prompts-per-step 32 --langrl-env-config env.yaml "
              "--inference-max-requests 64 --rl-amem-offload-during-rollout "
              "--rl-amem-backend nccl --rl-amem-keep-groups dp,hcp").split()


@functools.lru_cache(maxsize=None)
def _results(name, world, frozen_args):
    args = {k: list(v) if isinstance(v, tuple) else v for k, v in frozen_args}
    return tuple(r["result"] for r in run_ranks(f"{SCENARIOS}:{name}", world=world, args=args,
                                                timeout=180))


def results(name, world=2, **args):
    """Each scenario runs once per session; tests that read it share the result."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in args.items()))
    return _results(name, world, frozen)


@pytest.fixture
def hooks_removed():
    from amem_callbacks.adapters.megatron import remove_hooks

    yield
    remove_hooks()


def megatron_like_parser():
    """Built as Megatron's parse_args builds its parser (a stand-in: megatron-core
    from PyPI has no megatron.training), then the extra_args_provider is applied."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    rl = parser.add_argument_group(title="rl")
    rl.add_argument("--perform-rl-step", action="store_true")
    rl.add_argument("--grpo-group-size", type=int, default=2)
    rl.add_argument("--grpo-prompts-per-step", type=int, default=32)
    rl.add_argument("--langrl-env-config", type=str, default=None)
    dist = parser.add_argument_group(title="distributed")
    dist.add_argument("--tensor-model-parallel-size", type=int, default=1)
    dist.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    return parser


def add_inference_args(parser):
    """What train_rl.py passes as its own extra_args_provider."""
    parser.add_argument_group(title="inference").add_argument(
        "--inference-max-requests", type=int, default=8)
    return parser


def parse(argv):
    from amem_callbacks.adapters.megatron import add_args, chain

    provider = chain(add_inference_args, add_args)
    return provider(megatron_like_parser()).parse_args(argv)


def test_flags_parse_in_a_megatron_parser_chained_with_another_provider(hooks_removed):
    from amem_callbacks.adapters.megatron import Settings, settings_from_args

    args = parse(RL_COMMAND)
    assert args.tensor_model_parallel_size == 2 and args.inference_max_requests == 64
    settings = settings_from_args(args)
    # hcp is Megatron's ProcessGroupCollection spelling of hierarchical_cp
    assert settings == Settings(enabled=True, backend="nccl", keep=("dp", "hierarchical_cp"))
    off = settings_from_args(parse([]))
    assert off == Settings() and not off.enabled


@pytest.mark.parametrize("flag,value,expected", [
    ("--rl-amem-backend", "foo", "choose from 'auto', 'nccl', 'amem', 'noop'"),
    ("--rl-amem-keep-groups", "tp,bogus", "unknown group role(s) 'bogus': choose from cp, dp,"),
    ("--rl-amem-group-id", "-1", "must be an integer >= 0"),
])
def test_an_invalid_value_fails_at_parsing_with_the_choices(hooks_removed, capsys, flag, value,
                                                            expected):
    with pytest.raises(SystemExit) as exit_info:
        parse(["--rl-amem-offload-during-rollout", flag, value])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_no_learn_keep_flag_reaches_the_policy(hooks_removed):
    from amem_callbacks.adapters.megatron import RolloutOffload, settings_from_args

    settings = settings_from_args(parse(["--rl-amem-offload-during-rollout",
                                         "--rl-amem-no-learn-keep"]))
    assert settings.learn_keep is False and settings_from_args(parse([])).learn_keep is True
    assert RolloutOffload(settings).options.learn_keep is False
    assert RolloutOffload(settings).options.overlap is True  # off the critical path by default
    assert settings_from_args(parse(["--rl-amem-offload-during-rollout",
                                     "--rl-amem-blocking"])).options().overlap is False


def test_group_id_without_amem_is_ignored_with_a_warning(hooks_removed, caplog):
    from amem_callbacks.adapters.megatron import settings_from_args

    settings = settings_from_args(parse(["--rl-amem-offload-during-rollout",
                                         "--rl-amem-backend", "nccl", "--rl-amem-group-id", "3"]))
    assert settings.group_id is None and "applies to --rl-amem-backend amem" in caplog.text
    amem = settings_from_args(parse(["--rl-amem-offload-during-rollout", "--rl-amem-backend",
                                     "amem", "--rl-amem-group-id", "3"]))
    assert amem.backend_options() == {"amem": {"group_id": 3}}


@pytest.mark.parametrize("tp", [1, 2])
def test_parallel_state_groups_are_named_by_role(tp):
    for rank, res in enumerate(results("engine_cycle", tp=tp, cycles=2)):
        entries = {e["name"]: e for e in res["entries"]}
        assert res["mode"] == "in-place" and res["gloo_twins_left_out"]
        assert set(entries) == KEPT_IN_PLACE | IDLE_IN_PLACE
        assert sorted(entries) == res["discovered_names"]  # what reports and keep= see
        assert {n for n, e in entries.items() if e["keep"]} == KEPT_IN_PLACE
        assert "intra_dp_cp" in entries["dp_cp"]["roles"]  # one object, two roles
        assert "intra_expert_dp" in entries["expert_dp"]["roles"]
        assert entries["world"]["ranks"] == [0, 1]
        assert entries["tp"]["ranks"] == ([0, 1] if tp == 2 else [rank])
        assert entries["dp"]["ranks"] == ([rank] if tp == 2 else [0, 1])
        assert entries["dp"]["desc"] == "DATA_PARALLEL_GROUP"


def test_the_all_gather_group_is_found_and_suspended_in_either_release():
    """--create-all-gather-group's twin of dp_cp: a parallel_state global in 0.16, only
    on the model's ProcessGroupCollection in 0.19 (found by its description there);
    idle during the rollout either way, as dp_cp is."""
    for res in results("engine_cycle", ag=True, cycles=1):
        entries = {e["name"]: e for e in res["entries"]}
        assert not entries["dp_cp_ag"]["keep"], entries["dp_cp_ag"]
        assert entries["dp_cp_ag"]["desc"] == "DATA_PARALLEL_GROUP_WITH_CP_AG"
        during = res["cycles"][0]["during"]
        assert during["dp_cp_ag"] and during["dp_cp"]
        assert not any(res["cycles"][0]["after"].values()) and res["cycles"][0]["all_exact"]


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_resume_suspends_idle_groups_and_suspend_restores_them(tp):
    for res in results("engine_cycle", tp=tp, cycles=2):
        assert res["hooked"] == [True, True] and res["mode"] == "in-place"
        assert set(res["kept"]) == KEPT_IN_PLACE
        for n, cycle in enumerate(res["cycles"]):
            assert cycle["via"] == ["DynamicInferenceEngine.resume",
                                    "DynamicInferenceEngine.suspend"]
            assert {g for g, s in cycle["during"].items() if s} == IDLE_IN_PLACE
            assert cycle["still"] == cycle["during"]  # kept groups ran without resuming any
            assert not any(cycle["after"].values())
            assert cycle["kept_exact"] and cycle["all_exact"]
            assert cycle["begins_after_second_resume"] == n + 1  # no begin on a running engine
        assert res["counters"]["amem/total/begins"] == res["counters"]["amem/total/ends"] == 2
        # the engine's own resume/suspend bodies ran around the hooks
        assert res["context_calls"]["allocate"] == 2
        assert res["context_calls"]["deallocate"] == 2


def test_metrics_go_to_tensorboard_and_wandb_writers():
    for res in results("engine_cycle", tp=1, cycles=2):
        names = res["tensorboard_names"]
        assert all(name.startswith("amem/") for name in names)
        for name in ("amem/begin/groups_suspended", "amem/end/groups_resumed",
                     "amem/begin/group/dp/bytes", "amem/total/begins"):
            assert name in names
        assert res["wandb_calls"] == 4  # begin and end, two rollouts
        # overlapped: a begin's figures are written once it has finished (at the end)
        assert res["wandb_end"]["amem/begin/groups_suspended"] == len(IDLE_IN_PLACE)


def test_keep_groups_flag_keeps_those_groups_active():
    for res in results("engine_cycle", keep=["dp", "world"], cycles=1):
        during = res["cycles"][0]["during"]
        assert during["dp"] is False and during["world"] is False and during["dp_cp"] is True
        assert res["cycles"][0]["all_exact"]


def test_separate_inference_model_leaves_every_training_group_idle():
    for res in results("separate_engine"):
        assert res["mode"] == "separate"
        during = res["during"]
        assert during.pop("inference_tp") is False and during.pop("inference_pp") is False
        assert all(during.values()) and {"tp", "pp", "mp", "ep"} <= set(during)
        assert res["inference_ok"] and res["all_exact"] and not any(res["after"].values())


def test_amem_refuses_while_inference_uses_groups_of_the_process():
    for res in results("amem_in_place"):
        assert res["paused_during"] == 0 and res["all_exact"]
        assert "cannot keep" in res["begin"]["groups"]["dp"][1]


@pytest.mark.parametrize("drives_engine", [False, True])
def test_rl_interface_hook_brackets_each_rollout_once(drives_engine):
    # False: Megatron-LM at core_v0.16.1 (interface pauses the engines only);
    # True: 0.17+ (interface makes the engine suspend and resume as well).
    for res in results("interface_seam", drives_engine=drives_engine):
        assert res["patched"]
        end_via = "DynamicInferenceEngine.suspend" if drives_engine else "MegatronLocal.suspend"
        assert res["via"] == ["MegatronLocal.resume", end_via] * 2
        assert res["counters"]["amem/total/begins"] == res["counters"]["amem/total/ends"] == 2
        for cycle in res["cycles"]:
            assert {g for g, s in cycle["during"].items() if s} == IDLE_IN_PLACE
            assert not any(cycle["after"].values()) and cycle["exact"]
        calls = 2 if drives_engine else 0
        assert res["engine_calls"]["allocate"] == calls


def launcher(*argv, env=None, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "amem_callbacks.adapters.megatron", *argv],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_launcher_rejects_an_invalid_value_before_running_the_script():
    proc = launcher("tests/megatron_launch_target.py", "--rl-amem-backend", "nccl2")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "invalid choice: 'nccl2' (choose from 'auto', 'nccl', 'amem', 'noop')" in out


def test_launcher_runs_a_script_with_the_flags_and_hooks(tmp_path):
    port = str(free_port())
    argv = ["tests/megatron_launch_target.py", "--tensor-model-parallel-size", "1",
            "--rl-amem-offload-during-rollout", "--perform-rl-step", "--rl-amem-backend", "noop",
            "--rl-amem-keep-groups", "dp,world", "--grpo-group-size", "4", "--out", str(tmp_path)]
    procs = [launcher(*argv, env=dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    # two Megatron imports and a gloo rendezvous: minutes when other work shares the CPU
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for rank, out in enumerate(outs):
        res = json.load(open(tmp_path / f"rank{rank}.json"))
        assert res["script_args"]["grpo_group_size"] == 4  # the script got its own flags
        assert res["settings"] == {"enabled": True, "backend": "noop", "keep": ["dp", "world"],
                                   "group_id": None, "learn_keep": True, "overlap": True,
                                   "grow_kv_cache": False, "kv_margin_gb": 0.25,
                                   "reuse_host_backup": True}
        kinds = [(via, kind) for via, kind, _ in res["reports"]]
        assert kinds == [("DynamicInferenceEngine.resume", "begin"),
                         ("DynamicInferenceEngine.suspend", "end")] * 2
        begin = res["reports"][0][2]
        assert begin["dp"] == begin["world"] == begin["tp"] == "kept"
        assert begin["dp_cp"] == begin["expert_dp"] == "would suspend"
        assert f"[rank {rank}] amem_callbacks: rollout begin at DynamicInferenceEngine.resume: "\
               "begin('rollout') via noop: holding (up to 5 s, until the caller lets them "\
               "start) ['" in out  # overlapped: held until the engine's first tokens
        assert f"[rank {rank}] amem_callbacks: begin('rollout') via noop: would suspend" in out


def test_add_args_alone_reads_megatrons_global_args_and_writers():
    for rank, res in enumerate(results("args_provider")):
        assert res["settings"] == ["noop", ["world"]]
        assert [via for via, _ in res["reports"]] == ["DynamicInferenceEngine.resume",
                                                      "DynamicInferenceEngine.suspend"]
        begin = res["reports"][0][1]
        assert begin["world"] == begin["tp"] == "kept" and begin["dp"] == "would suspend"
        assert res["tensorboard_steps"] == [7] and res["tensorboard_names"] > 0
        assert res["wandb_calls"] == (2 if rank == 1 else None)


def test_launcher_names_a_missing_script_or_module_in_one_line():
    for target in (["nosuch_script.py"], ["-m", "no.such.module"]):
        proc = launcher(*target, "--rl-amem-offload-during-rollout")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 2 and "Traceback" not in out, out
        assert "no such script" in out or "no module named" in out


# --- issue #22: --overlap-param-gather, and the loop's own seam ------------------
def test_the_deferred_parameter_gather_runs_before_the_suspend():
    """Megatron-LM's loop with the distributed optimizer's overlapped param gather:
    without the fix the rollout's first forward gathers on dp_cp while it is
    suspended (the crash measured on GPU; here the fake NCCL's tripwire would end
    the process)."""
    for res in results("loop_seam", rollouts=3):
        assert res["events"] == ["launch", "generate", "broadcast"] + ["generate",
                                                                       "broadcast"] * 2
        first, *later = res["rounds"]
        # the first rollout begins after the launch (its broadcasts need dp and world)
        assert first["via"] == ["MegatronLocal.resume", "DynamicInferenceEngine.suspend"]
        for rollout in later:  # then as soon as the loop asks for rollouts
            assert rollout["via"] == ["get_environment_rollouts",
                                      "DynamicInferenceEngine.suspend"]
        for rollout in res["rounds"]:
            assert rollout["gathered"] == 1  # once per step, before the suspend
            assert rollout["hooks_on_after"] and not any(rollout["suspended_after"].values())
        assert res["staged"] == 3 and res["gathers_exact"] and res["all_exact"]
        assert res["guard_resumes"] == 0 and res["begins"] == 3


def test_without_the_fix_the_guard_sees_megatrons_import_bound_gather():
    """Mutation: the adapter skips the deferred gather. The gather then meets the
    suspended group through a name megatron-core bound at import, inside the
    coalescing manager; the ProcessGroup-level guard resumes the group first."""
    for res in results("loop_seam", rollouts=3, skip_param_sync=True):
        assert res["guard_resumes"] >= 1 and res["gathers_exact"] and res["all_exact"]


@pytest.mark.parametrize("margin_gb", [0.0, 0.125])
def test_one_replica_grows_at_the_same_step_by_its_smallest_freed_bytes(margin_gb):
    """Issue 32 on two ranks of one replica (TP 2): the rollout starts at once on the
    launch-size cache (the suspends still run), both ranks grow at the same step once
    both are over, by the smaller rank's freed bytes less the margin, max_requests
    following; the decisions, made from the ranks' agreed figures, are the same."""
    both = results("kv_growth", tp=2, mode="recompute", margin_gb=margin_gb, rollouts=3,
                   slow_suspends_ms=150)
    freed = [res["freed_bytes"] for res in both]
    assert freed[0] > freed[1] > 0  # the ranks' communicators differ in size
    margin = int(margin_gb * 2**30)
    launch = both[0]["rollouts"][0]["reports"][-1]
    assert launch["amem/kv_cache/grown"] == 0 and "no rollout measured" in launch["summary"]
    for res in both:  # each rollout's suspends wait for the engine's first tokens
        for rollout in res["rollouts"]:
            assert rollout["held_at_resume"] and rollout["held_seconds"] >= 0.2
            assert rollout["started_after_first_step_s"] < 3  # the bound is 5 s
    probe = [res["rollouts"][1] for res in both]
    for rollout in probe:
        assert not rollout["suspends_done_at_resume"]  # the resume did not wait for them
        at_resume, grown = rollout["reports"]
        assert at_resume["amem/kv_cache/blocks"] == 100 and at_resume["amem/kv_cache/grown"] == 0
        assert "grows once they are over" in at_resume["summary"]
        assert grown["amem/kv_cache/grown"] == 1 and grown["when"].startswith("step ")
        assert grown["amem/kv_cache/launch_max_requests"] == 96
        blocks = grown["amem/kv_cache/blocks"]
        extra = freed[1] - margin
        assert 100 + extra // (8 * 2**20 + 1000 * 8 + 4 * 34) == blocks  # the smaller rank's
        assert grown["amem/kv_cache/max_requests"] == (blocks - 1) // 4 * 4
        assert rollout["measured"]["amem/kv_cache/measured/grown"] == 1
    assert probe[0]["reports"][1]["when"] == probe[1]["reports"][1]["when"]  # the same step
    for res in both:
        grown_size = [blocks, (blocks - 1) // 4 * 4]
        # every rollout's resume allocates the launch size at once; the probe's regrow
        # follows; rollout 2 measures the launch size again (its only figure was the
        # launch's rollout, a process's warm-up) and does not grow
        assert res["allocations"] == [[100, 96], [100, 96], grown_size, [100, 96]]
        assert res["sized_for"][0] == grown_size[1]
        assert "measure the launch size again" in res["rollouts"][2]["decision"]
    assert [r["decision"] for r in both[0]["rollouts"]] == \
        [r["decision"] for r in both[1]["rollouts"]]


def test_a_persistent_kv_cache_is_never_grown_and_says_why():
    for res in results("kv_growth", tp=2, mode="persist", margin_gb=0.0, rollouts=2, steps=10):
        assert all(a == [100, 96] for a in res["allocations"]) and res["sized_for"] == []
        for rollout in res["rollouts"]:
            report = rollout["reports"][-1]
            assert report["amem/kv_cache/grown"] == 0 and rollout["decision"] is None
            assert "persist" in report["summary"] and "recompute" in report["summary"]


def test_without_fix_and_guard_the_gather_dies_on_the_suspended_group_as_on_gpu():
    """The scenario reproduces issue #22's crash: with neither the deferred-gather
    fix nor the guard, the gather reaches dp_cp's suspended communicator and the
    fake NCCL ends the process, as real NCCL did (illegal memory access). Blocking
    transitions, as in the crash: overlapped, the gather may win the race against
    dp_cp's suspend and the first death come on another group."""
    outcome = run_ranks(f"{SCENARIOS}:loop_seam", world=2, timeout=180, expect_ok=False,
                        allow_fake_nccl_fatal=True,
                        args={"rollouts": 2, "skip_param_sync": True, "no_guard": True,
                              "blocking": True})
    # the first rank to get there dies; its peer then fails on the broken connection
    assert all(r["returncode"] != 0 for r in outcome) and 86 in [r["returncode"] for r in outcome]
    assert any("on group 'dp_cp'" in line for r in outcome for line in r["fake_nccl_fatal"])
