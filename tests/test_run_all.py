"""tests/gpu/run_all.py's judging on CPU, with the suites' processes stood in:
a skipped suite is not a pass, a non-zero exit fails whatever the JSON says,
and the exit status tells failed, skipped and passed apart."""

import json
import os
import subprocess

import pytest

from tests.gpu import run_all


def done(code, stdout=""):
    return subprocess.CompletedProcess([], code, stdout=stdout, stderr="")


@pytest.mark.parametrize("exit_code, verdict, ok", [
    (0, None, True), (0, True, True), (0, False, False),
    (1, True, False),  # the JSON says ok, the process crashed after writing it
    (1, None, False), (None, True, False),  # None: it hung past the timeout
])
def test_a_suite_passes_only_when_its_process_exits_0(exit_code, verdict, ok):
    assert run_all.judge(exit_code, verdict) is ok


@pytest.mark.parametrize("states, status", [
    (["PASS", "PASS"], 0), (["PASS", "SKIP"], 3), (["SKIP"], 3), (["PASS", "SKIP", "FAIL"], 1),
    (["FAIL"], 1),
])
def test_the_exit_status_tells_failed_skipped_and_passed_apart(states, status):
    rows = {str(i): {"ok": None, "skipped": "why"} if s == "SKIP" else {"ok": s == "PASS"}
            for i, s in enumerate(states)}
    assert run_all.exit_status(rows) == status


def test_run_suite_ignores_an_ok_json_when_the_process_failed_and_a_stale_one(tmp_path):
    result = tmp_path / "core.json"

    def crashes_after_writing(command, **kwargs):
        result.write_text(json.dumps({"ok": True}))
        return done(134)
    row = run_all.run_suite(["x"], str(result), {}, 10, runner=crashes_after_writing)
    assert row["ok"] is False and row["exit_code"] == 134 and row["json_ok"] is True

    result.write_text(json.dumps({"ok": True}))  # from an earlier run in the same --out
    row = run_all.run_suite(["x"], str(result), {}, 10, runner=lambda c, **k: done(0))
    assert row["ok"] is True and "json_ok" not in row and not result.exists()

    def hangs(command, **kwargs):
        raise subprocess.TimeoutExpired(command, 10)
    row = run_all.run_suite(["x"], str(result), {}, 10, runner=hangs)
    assert row["ok"] is False and row["hung_past_s"] == 10


@pytest.fixture
def gpu_host(monkeypatch, tmp_path):
    """main() on CPU: a 1-GPU layout, one suite's bundle missing, stand-in processes."""
    from amem_callbacks.tools import launch

    monkeypatch.setattr(launch, "plan_ranks", lambda requested: launch.Layout(ranks=2, gpus=1))
    monkeypatch.setattr(run_all, "_missing",
                        lambda needs: "the bundle is not here" if needs == ".gpu/megatron" else None)
    exits = {}

    def fake_run(command, **kwargs):
        name = "doctor" if "doctor" in command else "core"
        if name == "core":  # the suite writes its verdict, then exits
            (tmp_path / "out" / "core.json").write_text(json.dumps({"ok": True}))
        return done(exits.get(name, 0), stdout="{}")
    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    return exits, tmp_path / "out"


def test_main_lists_a_skipped_suite_and_exits_3(gpu_host, capsys):
    _, out = gpu_host
    code = run_all.main(["--out", str(out), "--only", "doctor,core,megatron_rl"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 3
    assert lines[0].split()[:2] == ["doctor", "PASS"] and lines[1].split()[:2] == ["core", "PASS"]
    assert lines[2].split()[:2] == ["megatron_rl", "SKIP"] and "bundle is not here" in lines[2]
    summary = json.load(open(out / "summary.json"))
    assert summary["skipped"] == ["megatron_rl"] and summary["suites"]["megatron_rl"]["ok"] is None


def test_main_fails_a_suite_that_exits_nonzero_despite_its_json(gpu_host, capsys):
    exits, out = gpu_host
    exits["core"] = 1
    assert run_all.main(["--out", str(out), "--only", "doctor,core"]) == 1
    assert "core                   FAIL" in capsys.readouterr().out
    assert run_all.main(["--out", str(out), "--only", "doctor,core,megatron_rl"]) == 1
    exits["core"] = 0
    assert run_all.main(["--out", str(out), "--only", "doctor,core"]) == 0


def test_help_documents_the_exit_status_and_the_ranks_rule(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_all.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 all chosen suites ran and passed; 1 a suite failed; 3 none failed " \
           "but some were skipped" in text
    with pytest.raises(SystemExit):
        run_all.main(["--out", "x", "--ranks", "1"])
    assert "a whole number of ranks >= 2" in capsys.readouterr().err


def test_every_suite_names_a_script_here_and_flags_the_package_takes(tmp_path):
    """On a GPU host a moved script or a renamed tool flag fails its suite after
    minutes of set-up; here it fails at once, naming the suite."""
    from amem_callbacks.tools.cli import build_parser

    for name, (command, _needs, _result) in run_all.suites(2, str(tmp_path), 3).items():
        if command[1:3] == ["-m", "amem_callbacks.tools.cli"]:
            try:
                build_parser().parse_args(command[3:])
            except SystemExit:  # argparse has printed why
                pytest.fail(f"suite {name}: amem-callbacks refuses {command[3:]}")
        else:
            scripts = [arg for arg in command if arg.startswith("tests/")]
            assert scripts and all(os.path.isfile(os.path.join(run_all.ROOT, s))
                                   for s in scripts), (name, command)
