"""TRL adapter: a real GRPOTrainer on 2 gloo ranks, with and without AMemCallback."""

import functools
import os
import subprocess
import sys
import types

import pytest

from tests.harness import free_port, run_ranks

pytest.importorskip("trl")

CADENCES = ["1x1", "1x2", "2x1", "2x2"]
MAX_STEPS = 4


@functools.lru_cache(maxsize=None)
def results(scenario, **args):
    return [r["result"] for r in run_ranks(f"tests.scenarios_trl:{scenario}", world=2,
                                           args=args, timeout=280)]


def kinds(run, wanted=("begin", "end", "model.generate")):
    return [e["what"] for e in run["events"] if e["what"] in wanted]


def assert_same_training(run, baseline):
    assert run["loss"] == baseline["loss"] and len(run["loss"]) > 0
    assert run["grad_norm"] == baseline["grad_norm"]
    assert run["param_sum"] == baseline["param_sum"]


@pytest.mark.parametrize("cadence", CADENCES)
def test_one_suspend_and_resume_per_generation_whatever_the_cadence(cadence):
    spg, iterations = map(int, cadence.split("x"))
    generations = MAX_STEPS // (spg * iterations)
    steps = []
    for res in results("cadence", backend="fake", max_steps=MAX_STEPS):
        run = res[cadence]["amem"]
        assert kinds(run) == ["begin", "model.generate", "end"] * generations
        begins = [e for e in run["events"] if e["what"] == "begin"]
        # generation happens on the micro-steps that are not served from the buffer
        assert [e["step"] for e in begins] == list(range(0, MAX_STEPS, spg * iterations))
        steps.append([(e["what"], e["step"]) for e in run["events"]])
        assert run["counters"]["amem/total/begins"] == generations
        assert run["counters"]["amem/total/ends"] == generations
        assert all(e["skipped"] is None for e in run["events"] if e["what"] in ("begin", "end"))
    assert steps[0] == steps[1], "every rank takes the same transitions"


@pytest.mark.parametrize("cadence", CADENCES)
def test_groups_are_suspended_while_generating_and_active_before_the_gather(cadence):
    for res in results("cadence", backend="fake", max_steps=MAX_STEPS):
        run = res[cadence]["amem"]
        assert run["mode"] == "transformers" and run["kept"] == {}
        assert run["begin_groups"] == {"world": ["suspended", ""]}
        for event in run["events"]:
            if event["what"] == "model.generate":
                assert event["suspended"] == {"world": True}
            if event["what"] == "end":
                assert event["suspended"] == {"world": False}
        seams = [e["line"] for e in run["events"] if e["what"] == "seam"]
        assert all("(accelerator.gather): end" in line for line in seams if line.endswith("end"))
        # no collective ever reached a suspended group (the guard would have counted it)
        assert run["counters"]["amem/total/auto_resumes"] == 0


@pytest.mark.parametrize("cadence", CADENCES)
def test_training_is_identical_to_a_run_without_the_callback(cadence):
    for res in results("cadence", backend="fake", max_steps=MAX_STEPS):
        assert_same_training(res[cadence]["amem"], res[cadence]["baseline"])


def test_metrics_reach_the_trainer_logs():
    for res in results("cadence", backend="fake", max_steps=MAX_STEPS):
        run = res["1x1"]["amem"]
        begins = [log["amem/total/begins"] for log in run["amem_logs"]]
        assert begins == list(range(1, MAX_STEPS + 1))
        last = run["amem_logs"][-1]
        assert last["amem/begin/groups_suspended"] == 1
        assert last["amem/begin/nccl_bytes"] == 480 * 2**20
        assert last["amem/end/groups_resumed"] == 1 and last["amem/inert"] == 0
        assert all(not log for log in res["1x1"]["baseline"]["amem_logs"])


def test_ranks_that_call_the_model_a_different_number_of_times_take_one_transition():
    r0, r1 = [res["uneven"] for res in results("noop_runs")]
    for rank, res in enumerate((r0, r1)):
        run = res["amem"]
        per_generation = ["begin"] + ["model.generate"] * (rank + 2) + ["end"]
        assert kinds(run) == per_generation * 3
        assert run["counters"]["amem/total/auto_resumes"] == 0
        assert run["begin_groups"] == {"world": ["would suspend", ""]}
        assert_same_training(run, res["baseline"])
        # handed over explicitly with attach(): registered once, served
        assert run["attached"] and run["registered"] == 1
    steps = [[(e["what"], e["step"]) for e in r["amem"]["events"] if e["what"] in ("begin", "end")]
             for r in (r0, r1)]
    assert steps[0] == steps[1]


def test_vllm_server_mode_suspends_nothing_by_default_and_says_why():
    for res in results("vllm_modes", backend="fake", overlap=True):
        run = res["server"]["default"]
        assert run["mode"] == "vllm-server" and run["counters"]["amem/total/begins"] == 0
        lines = [e["line"] for e in run["events"] if e["what"] == "seam"]
        assert len(lines) == 1 and "suspend_in_server_mode=True" in lines[0]
        assert_same_training(run, res["server"]["baseline"])


def test_vllm_server_mode_suspends_while_rank_0_waits_for_the_server():
    r0, r1 = results("vllm_modes", backend="fake", overlap=True)
    for res in (r0, r1):
        run = res["server"]["amem"]
        assert run["mode"] == "vllm-server" and run["counters"]["amem/total/begins"] == 3
        assert run["counters"]["amem/total/auto_resumes"] == 0  # gathers before, broadcast after
        assert run["begin_groups"]["world"] == ["suspended", ""]
        assert_same_training(run, res["server"]["baseline"])
    on_rank0 = [e for e in r0["server"]["amem"]["events"] if e["what"] == "server.generate"]
    # overlap=True: the suspend runs while rank 0 waits for the server
    assert len(on_rank0) == 3 and all(e["phase"] == "rollout" for e in on_rank0)
    assert kinds(r0["server"]["amem"], ("sync_weights", "begin", "server.generate", "end")) == \
        ["sync_weights", "begin", "server.generate", "end"] * 3
    lines = [e["line"] for e in r1["server"]["amem"]["events"] if e["what"] == "seam"]
    assert lines == ["generation starts (waiting for the vLLM server): begin",
                     "generation over (broadcast of the server's completions): end"] * 3


def test_vllm_colocate_frees_memory_before_the_kv_cache_wakes_and_keeps_vllm_groups():
    """Checked on the second trainer a detached callback was attached to: its
    hooks on the new vLLM engine must be in place again."""
    for res in results("vllm_modes", backend="fake", overlap=True):
        assert res["colocate"]["first_of_two"]["counters"]["amem/total/begins"] == 1
        run = res["colocate"]["amem"]
        assert run["counters"]["amem/total/begins"] == 3
        assert run["mode"] == "vllm-colocate"
        assert set(run["kept"]) == {"vllm_tp", "vllm"}
        assert run["begin_groups"]["vllm_tp"][0] == run["begin_groups"]["vllm"][0] == "kept"
        assert run["begin_groups"]["world"][0] == "suspended"
        wakes = [e for e in run["events"] if e["what"] == "llm.wake_up"]
        assert len(wakes) == 3 and all(e["tags"] == ["kv_cache"] for e in wakes)
        # overlap=True, yet the suspend has finished when vLLM takes the memory
        assert all(e["suspended"]["world"] and e["last"] == ["begin", False] for e in wakes)
        assert all(not e["suspended"]["vllm_tp"] for e in wakes)
        assert kinds(run, ("sync_weights", "begin", "llm.wake_up", "end"))[:4] == \
            ["sync_weights", "begin", "llm.wake_up", "end"]
        assert run["counters"]["amem/total/auto_resumes"] == 0
        assert_same_training(run, res["colocate"]["baseline"])


@pytest.mark.parametrize("free, waited", [(64 * 2**30, 0), (0, (300 + 256) * 2**20),
                                          (None, None)])
def test_vllm_colocate_waits_only_for_what_vllms_kv_wake_up_lacks(free, waited):
    """The begin before vLLM's KV wake-up reads what vLLM maps (its allocator's
    sleeping KV cache, 300 MiB here) and waits only for what the free memory lacks
    (with the adapter's 256 MiB margin); unknown free memory waits for all, as before. Where
    nothing lacks on any rank, the second generation suspends nothing at all."""
    for res in results("colocate_allocating", backend="fake", free=free):
        run = res["amem"]
        fits = waited == 0
        assert run["counters"]["amem/total/begins"] == (1 if fits else 2)
        assert run["counters"]["amem/total/ends"] == (1 if fits else 2)
        assert run["metrics"]["amem/total/begins_not_needed"] == (1 if fits else 0)
        assert run["begin_groups"]["world"][0] == "suspended"
        assert run["waited_for_bytes"] == waited
        assert run["counters"]["amem/total/auto_resumes"] == 0
        assert_same_training(run, res["baseline"])
        # the headroom line (an 80 GiB GPU faked): the free memory read after vLLM's
        # generate bounds the raise; unknown free memory leaves the freed bytes alone
        metrics, share = run["metrics"], 0.3
        assert metrics["amem/headroom/gpu_memory_utilization_now"] == share
        if free is None:
            assert "amem/headroom/room_bytes" not in metrics
        elif fits:  # the second rollout suspended nothing: its groups count as free
            assert metrics["amem/headroom/room_bytes"] >= free // 2
        else:  # nothing stays free at the rollout's fullest: do not raise it
            assert metrics["amem/headroom/room_bytes"] == 0
            assert metrics["amem/headroom/gpu_memory_utilization"] == share


def test_a_later_generation_counts_what_the_last_one_took_not_vllms_whole_budget():
    """At the first generation only vLLM's whole budget bounds what comes (0.3 of an
    80 GiB GPU less the 300 MiB of weights mapped: more than the 8 GiB free), so the
    begin waits; that generation then took nothing beyond its 300 MiB KV wake-up, so
    the next one counts 300 MiB and every rank skips its begin."""
    budget = int(0.3 * 80 * 2**30) - 300 * 2**20
    for res in results("colocate_allocating", backend="fake", free=8 * 2**30,
                       total=80 * 2**30):
        run = res["amem"]
        assert run["counters"]["amem/total/begins"] == 1
        assert run["metrics"]["amem/total/begins_not_needed"] == 1
        # what the free memory lacked (this rank's part of it where a GPU host puts
        # both ranks on one device: then more)
        assert run["waited_for_bytes"] >= budget + 256 * 2**20 - 8 * 2**30
        assert_same_training(run, res["baseline"])


@pytest.mark.parametrize("neighbour_mib, generation_mib, later_begins", [
    (0, 0, 0), (63 * 1024, 0, 0), (0, 64 * 1024, 1)])
def test_the_next_estimate_counts_this_ranks_own_take_not_its_neighbours(
        neighbour_mib, generation_mib, later_begins):
    """What a generation took beyond its KV wake-up is read from this process's torch
    allocator: another rank on the GPU mapping its KV cache meanwhile (the free memory
    drops by 63 of 64 GiB) leaves the next begin skipped; this rank's own 64 GiB take
    makes it suspend."""
    for res in results("colocate_allocating", backend="fake", free=64 * 2**30,
                       neighbour_mib=neighbour_mib, generation_mib=generation_mib):
        run = res["amem"]
        assert run["counters"]["amem/total/begins"] == 1 + later_begins
        assert run["metrics"]["amem/total/begins_not_needed"] == 1 - later_begins
        assert_same_training(run, res["baseline"])


@pytest.mark.parametrize("short_rank, short_at", [(1, (2,)), (0, (2, 3))])
def test_a_kv_wake_up_that_falls_short_after_a_skipped_begin_suspends_then_wakes_again(
        short_rank, short_at):
    """From the second generation on every rank skips its begin (the faked free memory
    fits). Where one rank's vLLM wake-up runs out of memory anyway, every rank learns it
    in a store round and begins (suspends), that rank wakes again, the end resumes
    after generate, and training comes out as without the callback; the other
    generations stay skipped."""
    for rank, res in enumerate(results("colocate_short_wake", backend="fake",
                                       short_rank=short_rank, short_at=short_at)):
        run = res["amem"]
        late = len(short_at)
        assert run["metrics"]["amem/total/begins_after_short_allocation"] == late
        assert run["metrics"]["amem/total/begins_not_needed"] == 2 - late
        assert run["counters"]["amem/total/begins"] == 1 + late
        assert run["counters"]["amem/total/ends"] == 1 + late
        assert run["counters"]["amem/total/auto_resumes"] == 0
        fell = [e for e in run["events"] if e["what"] == "llm.wake_up fell short"]
        assert len(fell) == (late if rank == short_rank else 0)
        assert len([e for e in run["events"] if e["what"] == "llm.wake_up"
                    and "kv_cache" in (e.get("tags") or ["kv_cache"])]) == 3
        assert_same_training(run, res["baseline"])


def test_a_kv_wake_up_failing_otherwise_is_not_retried_and_no_rank_suspends_for_it():
    """Only running out of memory is the begin's to mend: another error from vLLM's
    wake-up (on every rank here, so none is left waiting in the trainer's next
    collective) reaches the trainer after the store round, with no begin anywhere."""
    for res in results("colocate_short_wake", backend="fake", short_rank="all",
                       short_at=(2,), error="CUDA Error: invalid argument"):
        run = res["amem"]
        assert "invalid argument" in run["raised"]
        assert run["metrics"]["amem/total/begins_after_short_allocation"] == 0
        assert run["metrics"]["amem/total/begins_not_needed"] == 1
        assert run["counters"]["amem/total/begins"] == 1  # the first generation's


@pytest.mark.parametrize("bad, words", [
    ({"backend": "cuda"}, "'auto', 'nccl', 'amem', 'noop'"),
    ({"guard": "loose"}, "('resume', 'strict', 'off')"),
    ({"keep": "tp"}, "list of group names"),
    ({"keep": ["nope"]}, "unknown group name"),
    ({"min_bites": 1}, "min_bytes"),
    ({"log_metrics": "yes"}, "True or False"),
])
def test_bad_options_fail_when_the_callback_is_made(bad, words):
    from amem_callbacks.adapters.trl import AMemCallback

    with pytest.raises(ValueError) as info:
        AMemCallback(**bad)
    assert words in str(info.value)


def test_a_trainer_that_does_not_generate_is_refused():
    from amem_callbacks.adapters.trl import AMemCallback

    trainer = types.SimpleNamespace(accelerator=object(),
                                    callback_handler=types.SimpleNamespace(callbacks=[]))
    with pytest.raises(ValueError, match="GRPOTrainer"):
        AMemCallback(backend="noop").attach(trainer)


def test_the_example_runs_as_a_cpu_demo_on_two_ranks():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "examples/trl_grpo.py", "--backend", "noop",
         "--steps", "2"], cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "begin('rollout') via noop: would suspend ['world']" in proc.stdout
    assert "'amem/total/begins': 2" in proc.stdout


def test_generation_that_gathers_parameters_keeps_the_default_group_and_says_so_once():
    for res in results("noop_runs"):
        run = res["fsdp"]
        assert run["kept"] == {"world": "FSDP gathers parameters on it while generating"}
        assert run["begin_groups"]["world"][0] == "kept"
        said = [e for e in run["events"] if "generation uses these groups" in e.get("line", "")]
        assert len(said) == 1 and "'world' (FSDP gathers" in said[0]["line"]
        assert run["counters"]["amem/total/begins"] == 2
        assert [name for name, _ in res["zero3"]] == ["world", res["zero3_key"]]
        assert all("DeepSpeed ZeRO-3 gathers parameters" in why for _, why in res["zero3"])


@pytest.mark.parametrize("kwargs, message", [
    ({"keep": 5}, "keep must be a list of group names"),
    ({"backend_options": {"nccl": 3}}, "backend_options['nccl'] must be a dict"),
    ({"backend_options": {"nccl": {"bogus": 1}}}, "backend 'nccl' has no option(s) ['bogus']"),
    ({"bogus": 1}, "AMemCallback: unknown option(s) ['bogus']: write one of"),
    ({"log_metrics": "yes"}, "log_metrics must be True or False"),
    ({"guard": "loose"}, "unknown guard mode 'loose'"),
])
def test_more_bad_options_fail_when_the_callback_is_made_as_amem_errors(kwargs, message):
    from amem_callbacks import AmemError
    from amem_callbacks.adapters.trl import AMemCallback

    with pytest.raises(ValueError) as err:
        AMemCallback(**kwargs)
    assert message in str(err.value) and isinstance(err.value, AmemError)


def test_attach_refuses_none_and_objects_that_do_not_generate():
    from amem_callbacks.adapters.trl import AMemCallback

    with pytest.raises(ValueError, match="attach\\(\\) needs the trainer"):
        AMemCallback().attach(None)
    with pytest.raises(ValueError, match="does not"):
        AMemCallback().attach(types.SimpleNamespace())
