"""The GPU soak script (tests/gpu/soak_gpu.py) in its CPU mode: gloo ranks and
the fake NCCL run the same program, so the script itself is checked here
before it spends device time."""

import json
import os
import subprocess
import sys

from tests.gpu.soak_gpu import flat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def soak(tmp_path, *args, timeout=240):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "tests/gpu/soak_gpu.py", "--cpu", "--out", str(out),
                          "--seconds", "120", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))
    return run, json.load(open(out))


def test_flat_rule_judges_after_warm_up_by_window_medians():
    assert flat([500] + [100] * 19)["ok"]  # the warm-up sample is left out
    assert flat([0] * 20)["ok"]
    assert not flat([100 + i for i in range(20)])["ok"]  # 10 % growth
    assert flat([1000, 1001, 999] * 7)["ok"]
    too_few = flat([100, 100, 100])
    assert too_few["ok"] is False and "needed" in too_few["why"]
    assert flat([None, None])["ok"] is None  # not measured (device memory on CPU)


def test_cpu_soak_passes_with_guard_learned_and_disagreement_cycles(tmp_path):
    run, result = soak(tmp_path, "--ranks", "4", "--cycles", "40", "--sample-every", "2",
                       "--disagree-every", "20")
    assert run.returncode == 0 and result["ok"], (run.stdout[-3000:], result.get("failures"))
    assert result["cycles"] == 40 and result["groups_per_rank"] >= 16
    assert "soak: cycle 10" in run.stdout  # progress lines reach the driver's output
    for counts in result["special_cycles"].values():  # guard at 3, 13, ..; disagree at 12, 32
        assert counts["guard"] == 4 and counts["learned"] == 4 and counts["disagree"] == 2
    for name, per_rank in result["flat"].items():
        expected = None if name.startswith("device_free") else True
        assert all(v["ok"] is expected for v in per_rank.values()), (name, per_rank)
    first = result["first_sample"]["0"]
    assert first["during"]["suspended_bytes"] == 16 * 32 * 2**20  # 16 groups x the fake's 32 MiB
    assert result["plot"].endswith(".png") or "matplotlib" in result["plot"]
    assert "soak_gpu.py" in result["command"] and result["versions"]["nccl_loaded"]


def test_an_injected_wrong_result_turns_the_verdict_red(tmp_path):
    run, result = soak(tmp_path, "--ranks", "2", "--cycles", "8", "--sample-every", "1",
                       "--inject-wrong-at", "5", "--no-plot")
    assert run.returncode == 1 and not result["ok"]
    assert result["verdict"]["no_failure"] is False and result["verdict"]["no_hang"]
    for failures in result["failures"].values():  # both members see the wrong sum
        assert {"cycle": 5, "what": "after/world exact"} in failures
    assert "FAIL" in run.stdout


def test_a_run_past_its_wall_limit_is_a_failure(tmp_path):
    # the last rank never leaves cycle 3; the other waits for it at the gloo barrier
    run, result = soak(tmp_path, "--ranks", "2", "--wall", "40", "--seconds", "30",
                       "--inject-hang-at", "3", "--no-plot")
    assert run.returncode == 1 and not result["ok"]
    assert result["killed"] == "hung past the wall limit" and not result["verdict"]["no_hang"]
    assert result["missing_results"] == [0, 1]
