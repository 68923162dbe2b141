"""The command line: doctor (text and JSON), the CPU demo, and the options' rules.

Written for a machine with or without a GPU: the demo is asked for its CPU dry
run explicitly (CUDA_VISIBLE_DEVICES=""), and the doctor's expectations follow
the torch build installed."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from amem_callbacks import __version__
from amem_callbacks.tools.cli import build_parser, output_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # honoured by every CUDA torch: a dry run anywhere


def run(*args, timeout=300, env=None, module="amem_callbacks.tools.cli"):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def cuda_torch() -> bool:
    import torch

    return torch.version.cuda is not None


def test_doctor_json_names_the_backend_and_each_fix_and_exits_1_when_inert():
    out = run("doctor", "--json", "--no-probe")
    report = json.loads(out.stdout)
    inert = report["backend"] == "none (training runs unchanged)"
    assert out.returncode == (1 if inert else 0), out.stderr  # a launch script can gate on it
    assert report["facts"]["torch"].startswith("2.")
    assert all(p["fix"] for p in report["problems"])
    if not cuda_torch():  # a CPU torch loads no NCCL: nothing to suspend, and it says why
        assert inert and "no NCCL library is loaded" in report["backend_reason"]


def test_doctor_says_how_new_host_blocks_are_pinned_and_flags_a_bad_kind():
    report = json.loads(run("doctor", "--json", "--no-probe").stdout)
    assert report["facts"]["host_backup_new_blocks"] == "registered"
    bad = json.loads(run("doctor", "--json", "--no-probe",
                         env={"AMEM_HOST_BACKUP_BLOCKS": "pinned"}).stdout)
    assert "host_backup_new_blocks" not in bad["facts"]
    (problem,) = [p for p in bad["problems"] if "AMEM_HOST_BACKUP_BLOCKS" in p["what"]]
    assert "registered or allocated" in problem["fix"]


def test_doctor_text_flags_amem_in_ld_preload_and_cumem_off(monkeypatch):
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    monkeypatch.setenv("LD_PRELOAD", "")
    out = run("doctor")
    assert "NCCL_CUMEM_ENABLE=0: suspend would succeed and free nothing" in out.stdout


@pytest.fixture
def no_numpy(tmp_path):
    """PYTHONPATH that hides numpy the way a fresh venv lacks it (torch then has no numpy)."""
    fake = tmp_path / "nonumpy" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    return str(fake.parent)


def test_demo_runs_a_dry_run_on_two_cpu_ranks_without_numpy(tmp_path, no_numpy):
    out = run("demo", "--steps", "2", "--rollout-s", "0.05", "--out", str(tmp_path / "o"),
              env=dict(CPU_ONLY, PYTHONPATH=no_numpy + os.pathsep + ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NumPy" not in out.stderr  # torch's warning, in every process, says nothing useful here
    assert "2 CPU processes, gloo (dry run" in out.stdout
    table = [line for line in out.stdout.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(table) == 2 and all("world,dp,ep" in line for line in table)
    assert "kept active: tp" in out.stdout
    summary = out.stdout[out.stdout.index("summary"):]
    assert "DRY RUN" in summary and "would suspend at each rollout: world, dp, ep" in summary
    assert "begin took" in summary and "end" in summary and "MiB" in summary
    assert "{" not in summary  # words, not the raw metrics dict
    path = str(tmp_path / "o" / "demo.json")
    assert f"full metrics: {path}" in summary
    data = json.load(open(path))
    assert data["dry_run"] is True and len(data["steps"]) == 2
    assert data["steps"][0]["groups"] == {"world": "would suspend", "dp": "would suspend",
                                          "tp": "kept", "ep": "would suspend"}
    metrics = data["metrics_rank0"]  # a dry run's figures name what it would have done
    assert metrics["amem/begin/groups_would_suspend"] == 3 and metrics["amem/inert"] == 0
    assert all(metrics[f"amem/begin/group/{name}/would_suspend"] == 1
               for name in ("world", "dp", "ep"))


def test_bad_flags_fail_with_the_choices():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--backend", "fast"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--steps", "0"])


def _error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("tool", ["demo", "bench"])
def test_one_rule_for_ranks_with_one_message(tool, capsys):
    messages = {value: _error_of([tool, "--ranks", value], capsys)
                for value in ("0", "1", "-3", "x", "2.5")}
    for value, message in messages.items():
        assert message.endswith(f"argument --ranks: a whole number of ranks >= 2 (a 1-rank "
                                f"communicator has no peer buffers to free) and <= 1024, "
                                f"got '{value}'")
    assert build_parser().parse_args([tool, "--ranks", "2"]).ranks == 2


@pytest.mark.parametrize("argv, words", [
    (["demo", "--rollout-s", "-1"],
     "argument --rollout-s: a number of seconds > 0 and <= 3600, got '-1'"),
    (["demo", "--rollout-s", "0"], "a number of seconds > 0 and <= 3600, got '0'"),
    (["bench", "--train-s", "-5"],
     "argument --train-s: a number of seconds > 0 and <= 3600, got '-5'"),
    (["bench", "--rollout-s", "nan"], "a number of seconds > 0 and <= 3600, got 'nan'"),
    (["bench", "--train-s", "soon"], "a number of seconds > 0 and <= 3600, got 'soon'"),
    (["demo", "--steps", "x"], "argument --steps: a whole number >= 1 and <= 100000, got 'x'"),
    (["bench", "--sweep", "1,a"], "a comma list of whole numbers >= 1"),
    (["bench", "--modes", "naive"], "that includes 'none' (the baseline), got 'naive'"),
])
def test_bad_values_say_what_is_wanted(argv, words, capsys):
    message = _error_of(argv, capsys)
    assert words in message and "invalid" not in message


def test_every_option_has_help():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help"


def test_version_and_python_m_without_importing_torch():
    out = run("--version", module="amem_callbacks")
    assert out.returncode == 0 and out.stdout.strip() == f"amem-callbacks {__version__}"
    code = ("import sys, runpy; sys.argv = ['amem_callbacks', 'bench', '--help'];\n"
            "try: runpy.run_module('amem_callbacks', run_name='__main__')\n"
            "except SystemExit as e: print('exit', e.code, 'torch' in sys.modules)")
    help_run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60)
    assert help_run.stdout.strip().endswith("exit 0 False"), help_run.stderr
    assert "--full" in help_run.stdout and "--train-s" in help_run.stdout


@pytest.mark.parametrize("tool", ["demo", "bench"])
def test_an_unwritable_out_fails_at_once_in_one_line(tool):
    start = time.monotonic()
    out = run(tool, "--out", "/proc/forbidden")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"amem-callbacks {tool}: cannot write to --out /proc/forbidden: "), out.stderr
    assert out.stdout == "" and time.monotonic() - start < 30  # nothing ran


def test_default_output_folder_is_under_the_temp_folder_not_the_working_one():
    folder = output_folder(None, "bench")
    assert os.path.dirname(folder) == tempfile.gettempdir()
    assert os.path.basename(folder).startswith("amem-bench-")
    assert output_folder("mine", "bench") == "mine"


def test_doctor_turns_a_freed_figure_into_the_vllm_share_and_says_how_to_get_one():
    from amem_callbacks.tools.cli import main

    with_figure = subprocess.run(
        [sys.executable, "-m", "amem_callbacks", "doctor", "--no-probe", "--freed-gb", "10",
         "--vllm-utilization", "0.6", "--gpu-gb", "140"], capture_output=True, text=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert "raise gpu_memory_utilization from 0.6 to 0.6678 " in with_figure.stdout  # 0.6 + 9.5 / 140
    without = subprocess.run([sys.executable, "-m", "amem_callbacks", "doctor", "--no-probe"],
                             capture_output=True, text=True,
                             env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert "amem_callbacks: headroom:" in without.stdout and "--freed-gb" in without.stdout
    assert main(["doctor", "--freed-gb", "3"]) == 2
