"""tests/gpu/verl_e2e.py on CPU: the fixture it builds, the job's config composed and
checked by verl 0.9.1's own code (the adapter's entry included), the record a run
leaves. The job itself needs a GPU, Ray and vLLM (issue 62)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

pytest.importorskip("verl")
pytest.importorskip("hydra")

from tests.gpu import verl_e2e as e2e  # noqa: E402


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("verl_fixture"))
    made = e2e.make_fixture(folder)
    assert made["tokens"] <= 512  # the model's vocabulary holds the tokenizer's
    return folder


def test_the_fixture_is_a_model_verl_can_load_and_data_it_can_read(fixture):
    import pandas as pd
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(fixture, "model"))
    assert "assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 1 plus 2"}], add_generation_prompt=True,
        tokenize=False)
    assert AutoConfig.from_pretrained(os.path.join(fixture, "model")).model_type == "qwen2"
    train = pd.read_parquet(os.path.join(fixture, "train.parquet"))
    assert len(train) == e2e.PROMPTS and train.iloc[3]["reward_model"]["ground_truth"] == "4"
    namespace = {}
    exec(open(os.path.join(fixture, "reward.py")).read(), namespace)
    assert namespace["compute_score"]("toy_add", "the answer is 4", "4") == 1.0


@pytest.mark.parametrize("amem", [True, False])
def test_the_jobs_config_passes_verls_own_checks(fixture, amem):
    config, rollout = e2e.compose(e2e.overrides(fixture, amem, share=0.2, steps=3))
    assert rollout.name == "vllm" and rollout.tensor_model_parallel_size == 1
    assert rollout.enable_sleep_mode and rollout.free_cache_engine  # what the adapter hooks
    assert rollout.gpu_memory_utilization == 0.2
    assert (dict(rollout.custom or {}).get("amem") == {"enable": True}) is amem
    assert config.actor_rollout_ref.actor.strategy == "fsdp2"
    assert config.trainer.total_training_steps == 3
    ray_init = config.ray_kwargs.ray_init
    assert ray_init.num_gpus == 2  # the harness's two ranks on one card
    env_vars = ray_init.runtime_env.env_vars
    assert env_vars.CUDA_VISIBLE_DEVICES == "0"  # a string, not 0
    assert env_vars.NCCL_MULTI_RANK_GPU_ENABLE == "1" and env_vars.VLLM_USE_FLASHINFER_SAMPLER == "0"


def test_a_bad_amem_key_stops_the_job_at_its_config_with_the_valid_keys(fixture):
    with pytest.raises(Exception, match=r"unknown key\(s\) \['bogus'\]; valid keys: enable"):
        e2e.compose(e2e.overrides(fixture, True)
                    + ["+actor_rollout_ref.rollout.custom.amem.bogus=1"])


def test_the_environment_leaves_the_devices_to_ray():
    env = e2e.environment({"CUDA_VISIBLE_DEVICES": "0", "PATH": "/bin"})
    assert "CUDA_VISIBLE_DEVICES" not in env and env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_a_runs_record_holds_every_step_and_the_amem_figures(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "data": {"timing_s/step": 2.0 + s, "timing_s/gen": 1.0,
                                 "actor/pg_loss": 0.1 * s, "amem/begin/groups_suspended": 1,
                                 "amem/host_backup/reused": 320 * (s - 1)}} for s in (1, 2, 3)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = e2e.record("with-0", True, 0.15, ["python", "-m", "x"], 0, 99.0, "done", str(metrics))
    assert got["ok"] and got["steps"] == 3 and got["step_s"] == [3.0, 4.0, 5.0]
    assert got["amem_keys"] == ["amem/begin/groups_suspended", "amem/host_backup/reused"]
    assert got["amem_last"]["amem/host_backup/reused"] == 640 and not got["oom"]
    assert got["commit"] and {"torch", "card", "nccl_loaded"} <= set(got["machine"])
    failed = e2e.record("base-0", False, 0.3, ["x"], 1, 5.0,
                        "ValueError: Free memory on device (10.1/79.2 GiB) on startup is less "
                        "than desired GPU memory utilization", str(tmp_path / "none.jsonl"))
    assert not failed["ok"] and failed["oom"] and failed["steps"] == 0


def test_a_run_ends_its_whole_process_group_and_records_it(tmp_path, monkeypatch):
    # the job's process stands in for main_ppo: it writes a step and exits 0
    script = ("import json,os;open(os.environ['VERL_FILE_LOGGER_PATH'],'w').write("
              "json.dumps({'step':1,'data':{'timing_s/step':1.5}})+'\\n');"
              "print('\\x1b[36m(WorkerDict pid=12)\\x1b[0m up');print('trained')")
    real_popen, stops = e2e.subprocess.Popen, []

    def popen(command, **kwargs):
        if command[1:] == ["-m", "ray.scripts.scripts", "stop", "--force"]:  # the job's Ray
            stops.append(command[1:])
            return real_popen(["true"], **kwargs)
        if "verl.trainer.main_ppo" not in command:  # git, for the record's commit
            return real_popen(command, **kwargs)
        assert kwargs["start_new_session"]
        assert "CUDA_VISIBLE_DEVICES" not in kwargs["env"]
        return real_popen([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(e2e.subprocess, "Popen", popen)
    got = e2e.run(str(tmp_path), "base-0", "/fixture", False, 0.15, 1, timeout_s=60)
    assert got["ok"] and got["step_s"] == [1.5] and "trained" in got["tail"]
    assert stops == [["-m", "ray.scripts.scripts", "stop", "--force"]]
    assert json.load(open(tmp_path / "base-0" / "record.json"))["rc"] == 0
    # every line of the job's log carries its time, and each Ray process its first one
    lines = (tmp_path / "base-0" / "log.txt").read_text().splitlines()
    assert lines and all(re.match(r"^\[ *[0-9.]+ s\] ", line) for line in lines)
    assert list(got["first_seen_s"]) == ["WorkerDict 12"]
    assert 0 <= got["first_seen_s"]["WorkerDict 12"] < 60


def test_first_seen_reads_each_ray_process_once_in_the_stamped_log():
    log = ("[    1.0 s] starting\n"
           "[    3.5 s] \x1b[36m(TaskRunnerV1 pid=7)\x1b[0m config\n"
           "[   60.2 s] \x1b[36m(WorkerDict pid=9)\x1b[0m up\n"
           "[   61.0 s] (WorkerDict pid=9) again\n"
           "[  140.7 s] (vLLMHttpServer pid=11) ['serve',\n")
    assert e2e.first_seen(log) == {"TaskRunnerV1 7": 3.5, "WorkerDict 9": 60.2,
                                   "vLLMHttpServer 11": 140.7}


def _write_run(out, name, amem, losses, last=None, ok=True):
    folder = out / name
    folder.mkdir()
    (folder / "record.json").write_text(json.dumps({
        "name": name, "amem": amem, "ok": ok, "steps": len(losses), "pg_loss": losses,
        "amem_keys": sorted(last or {}), "amem_last": last or {},
        "amem_begins": [s + 1 for s in range(len(losses))] if amem else [None] * len(losses)}))


def _amem_last(**change):
    figures = {"amem/total/begins": 22, "amem/total/ends": 21, "amem/total/group_suspends": 44,
               "amem/total/auto_resumes": 0, "amem/total/failures": 0,
               "amem/verl/suspends_before_kv_cache": 21, "amem/verl/suspends_before_launch": 1,
               "amem/verl/ends_at_sleep_replicas": 21,
               "amem/begin/nccl_bytes": 300 << 20, "amem/begin/gpu_wide_freed_bytes": 580 << 20}
    figures.update(change)
    return figures


def test_verify_reads_item_2_from_the_records_and_names_each_check_that_fails(tmp_path):
    steps = 20
    _write_run(tmp_path, "base-0", False, [0.10] * steps)
    _write_run(tmp_path, "base-1", False, [0.14] * steps)
    _write_run(tmp_path, "amem-0", True, [0.12] * steps, _amem_last())
    got = e2e.verify(str(tmp_path), steps)
    assert got["ok"], got["checks"]
    assert got["figures"]["amem-0"]["loss_gap_between_runs_without"] == [pytest.approx(0.04)]
    # each seam missed, and the losses apart, fail their own check and only it
    for change, check in ((dict(**{"amem/verl/ends_at_training_call": 3}), "ended_at_sleep_replicas"),
                          (dict(**{"amem/verl/suspends_before_kv_cache": 0}),
                           "suspended_before_every_kv_wake_up"),
                          (dict(**{"amem/verl/suspends_before_launch": 0,
                                   "amem/total/begins": 21}), "suspended_before_launch"),
                          (dict(**{"amem/total/auto_resumes": 1}), "no_guard_resume"),
                          (dict(**{"amem/begin/gpu_wide_freed_bytes": 10 << 20}),
                           "memory_freed_before_kv")):
        (tmp_path / "amem-0" / "record.json").unlink()
        (tmp_path / "amem-0").rmdir()
        _write_run(tmp_path, "amem-0", True, [0.12] * steps, _amem_last(**change))
        got = e2e.verify(str(tmp_path), steps)
        failed = [k for k, v in got["checks"]["amem-0"].items() if not v]
        assert failed == [check] and not got["ok"]
    _write_run(tmp_path, "amem-1", True, [0.5] * steps, _amem_last())
    assert not e2e.verify(str(tmp_path), steps)["checks"]["amem-1"]["losses_within_runs_without"]
    # one run without the package is no yardstick for the losses
    (tmp_path / "base-1" / "record.json").unlink()
    assert not e2e.verify(str(tmp_path), steps)["ok"]


def test_the_ballast_holds_until_killed_and_a_failed_one_says_why(monkeypatch):
    # the holder's script stands in for torch's allocation on card 0
    monkeypatch.setattr(e2e, "BALLAST", "import sys, time\nprint('held', sys.argv[1], "
                        "flush=True)\ntime.sleep(60)\n")
    assert e2e.hold_ballast(0) is None
    holder = e2e.hold_ballast(1.5)
    try:
        assert holder.poll() is None  # still holding
    finally:
        holder.kill()
        holder.wait(10)
    monkeypatch.setattr(e2e, "BALLAST", "raise SystemExit('CUDA out of memory')\n")
    with pytest.raises(RuntimeError, match="did not hold: .*CUDA out of memory"):
        e2e.hold_ballast(1.0, timeout_s=30)


def test_kv_tokens_follow_the_fixtures_model(fixture):
    # 2 layers x 2 KV heads x 64 dims, K and V, bf16
    assert e2e.kv_bytes_per_token(fixture) == 2 * 2 * 2 * 64 * 2
    assert e2e.kv_bytes_per_token("/nonexistent") is None


def test_the_cards_peak_is_the_most_nvidia_smi_reported(monkeypatch):
    answers = iter(["1000, 81559\n", "5000, 81559\n", "3000, 81559\n"])

    def smi(command, **kwargs):
        assert command == e2e.PeakUsed.QUERY
        try:
            return subprocess.CompletedProcess(command, 0, next(answers), "")
        except StopIteration:
            raise OSError("no more")
    monkeypatch.setattr(e2e.subprocess, "run", smi)
    peak = e2e.PeakUsed(every_s=0.01)
    peak.start()
    peak.join(10)  # ends when the answers run out
    assert peak.stop() == {"peak_used_mib": 5000, "total_mib": 81559}
    # no nvidia-smi at all (the CPU): nothing seen, said as None
    monkeypatch.setattr(e2e.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError()))
    empty = e2e.PeakUsed(every_s=0.01)
    empty.start()
    assert empty.stop() == {"peak_used_mib": None, "total_mib": None}
