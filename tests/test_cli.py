"""The command line: doctor (text and JSON) and the CPU demo."""

import json
import subprocess
import sys

import pytest

from amem_callbacks.tools.cli import build_parser


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "amem_callbacks.tools.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_doctor_json_names_the_backend_and_each_fix_and_exits_1_when_inert():
    out = run("doctor", "--json")
    assert out.returncode == 1, out.stderr  # a launch script can gate on it
    report = json.loads(out.stdout)
    assert report["facts"]["torch"].startswith("2.")
    assert report["backend"] == "none (training runs unchanged)"
    assert "no NCCL library is loaded" in report["backend_reason"]
    assert all(p["fix"] for p in report["problems"])


def test_doctor_text_flags_amem_in_ld_preload_and_cumem_off(monkeypatch):
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    monkeypatch.setenv("LD_PRELOAD", "")
    out = run("doctor")
    assert "NCCL_CUMEM_ENABLE=0: suspend would succeed and free nothing" in out.stdout


def test_demo_runs_a_dry_run_on_two_cpu_ranks():
    out = run("demo", "--steps", "2", "--rollout-s", "0.05")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 CPU processes, gloo (dry run" in out.stdout
    table = [line for line in out.stdout.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(table) == 2 and all("world,dp,ep" in line for line in table)
    assert "kept active: tp" in out.stdout


def test_bad_flags_fail_with_the_choices():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--backend", "fast"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--steps", "0"])
