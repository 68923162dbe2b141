"""Issue 33, bad input, second pass: every number is checked where it comes in,
nothing that passes can fail later, a failed or refused call leaves nothing
applied, and the dry run says only what it measured. One test per case of the
issue; multi-rank ones on gloo with the fake NCCL (tests/harness.py)."""

import inspect
import json
import math
import os
import re
import subprocess
import sys

import pytest

from amem_callbacks import OffloadPolicy
from amem_callbacks.errors import OptionError
from tests.harness import run_ranks
from tests.requires import needs_modules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
_cache = {}


def results(scenario: str, world: int = 2, timeout: float = 180) -> list:
    """Each scenario runs once per test session (several tests read it)."""
    if scenario not in _cache:
        _cache[scenario] = [r["result"] for r in run_ranks(f"tests.scenarios:{scenario}",
                                                           world=world, timeout=timeout)]
    return _cache[scenario]


def cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "amem_callbacks", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, **(env or {})))


# --- every number is checked at construction, with its range -----------------------------

WAIT = "<= 9223372036 (threading.TIMEOUT_MAX: the longest wait a Python lock takes"


@pytest.mark.parametrize("kwargs, message", [
    ({"timeout_s": math.inf}, f"timeout_s must be a number > 0 and {WAIT}"),
    ({"timeout_s": 1e12}, f"timeout_s must be a number > 0 and {WAIT}"),
    ({"timeout_s": math.nan}, "timeout_s must be a number > 0 and <= 9223372036"),
    ({"timeout_s": 10**400}, "got 1000000000"),  # a 400-digit value is cut short, not quoted whole
    ({"agree_timeout_s": math.inf}, "agree_timeout_s must be a number > 0 and <= 4611686018 "
                                    "(half threading.TIMEOUT_MAX: members wait up to twice it)"),
    ({"agree_timeout_s": 5e9}, "agree_timeout_s must be a number > 0 and <= 4611686018"),
    ({"workers": 10**6}, "workers must be an integer >= 1 and <= 256"),
    ({"min_bytes": 2**64}, "min_bytes must be an integer >= 0 and <= 9223372036854775807"),
    ({"need_bytes": 2**64}, "need_bytes must be an integer >= 0 and <= 9223372036854775807"),
    ({"host_memory_cap_bytes": 1.5}, "host_memory_cap_bytes must be an integer >= 0"),
    ({"device": 2**31}, "device must be an integer >= 0 and <= 2147483647 (cudaSetDevice"),
    ({"backend_options": {"amem": {"group_id": 2**31}}},
     "backend_options['amem']['group_id'] must be an integer >= 0 and <= 2147483647 "
     "(ncclSetGroupID takes a C int)"),
])
def test_every_number_is_checked_for_type_finiteness_and_range(kwargs, message):
    with pytest.raises(OptionError) as err:
        OffloadPolicy(**kwargs)
    assert message in str(err.value)
    assert len(str(err.value)) < 300


def test_the_callback_refuses_an_infinite_timeout_when_it_is_made():
    from amem_callbacks.adapters.trl import AMemCallback

    for options in ({"timeout_s": math.inf}, {"agree_timeout_s": math.inf}):
        with pytest.raises(OptionError, match=r"must be a number > 0 and <= \d+"):
            AMemCallback(**options)


def test_verl_takes_no_number_so_a_timeout_key_is_refused_with_the_valid_keys():
    from amem_callbacks.adapters._verl_config import read_settings

    with pytest.raises(OptionError) as err:
        read_settings({"amem": {"enable": True, "agree_timeout_s": math.inf}})
    assert "unknown key(s) ['agree_timeout_s']; valid keys: enable" in str(err.value)


@pytest.mark.parametrize("argv, message", [
    (["--rl-amem-group-id", "2147483648"],
     "--rl-amem-group-id: must be an integer >= 0 and <= 2147483647 (ncclSetGroupID"),
    (["--rl-amem-kv-cache-margin-gb", "inf"],
     "--rl-amem-kv-cache-margin-gb: must be a number of GB >= 0 and <= 1048576"),
    (["--rl-amem-kv-cache-margin-gb", "1e300"], "must be a number of GB >= 0 and <= 1048576"),
])
def test_megatron_numeric_flags_state_their_range(argv, message, capsys):
    from amem_callbacks.adapters.megatron.args import launcher_parser

    with pytest.raises(SystemExit) as exit_:
        launcher_parser().parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--workers", "100000"], "a whole number of threads >= 1 and <= 256, got '100000'"),
    (["bench", "--groups", "13"], "a whole number of groups >= 1 and <= 12"),
    (["bench", "--rollout-s", "1e300"], "a number of seconds > 0 and <= 3600, got '1e300'"),
    (["bench", "--sweep", "1,4,100000"], "whole numbers >= 1 and <= 256"),
    (["demo", "--ranks", "100000"], "a whole number of ranks >= 2"),
    (["doctor", "--freed-gb", "1e300"], "a number of GB >= 0 and <= 1048576 (more than any GPU "
                                          "holds), got '1e300'"),
    (["doctor", "--gpu-gb", "inf"], "a number of GB >= 0 and <= 1048576 (more than any GPU "
                                    "holds), got 'inf'"),
])
def test_cli_numbers_state_their_range(argv, message, capsys):
    from amem_callbacks.tools.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_largest_accepted_timeouts_run_whole_phases():
    for rank_result in results("longest_waits"):
        for overlap, run in rank_result.items():
            assert run["during"] == {"dp": True, "ep": True, "tp": False, "world": True}, overlap
            assert run["after"] == {"dp": False, "ep": False, "tp": False, "world": False}
            assert run["exact"] and run["freed"] > 0
            assert not run["phase_open"] and run["held"] == [] and not run["guard_installed"]


# --- phases do not nest; a failed begin or end leaves nothing applied -------------------

def test_a_nested_phase_fails_at_entry_and_leaves_the_outer_one_intact():
    suspended = {"dp": True, "ep": True, "tp": False, "world": True}
    for res in results("nested_phase"):
        assert not res["inner_ran"]
        assert res["error"].startswith("phase('rollout') entered while phase 'rollout' is open: "
                                       "phases do not nest")
        assert res["before"] == suspended
        assert res["after_refusal"] == {"phase_open": True, "suspended": suspended,
                                        "held": ["world", "dp", "ep"]}
        assert res["second_begin"] == "phase 'rollout' is already active"  # begin: warned
        assert res["after_second_begin"] == suspended
        assert res["after"] == dict.fromkeys(suspended, False) and res["exact"]
        # the guard never had to resume world, so nothing was learned or kept from it
        assert res["auto_resumes"] == 0 and res["learned"] == {}
        assert res["next_phase"] == {"world": "suspended", "dp": "suspended", "ep": "suspended",
                                     "tp": "kept"}
        assert res["end"] == {"phase_open": False, "held": [], "watched": 0,
                              "guard_installed": False}


def test_a_begin_or_end_that_raises_leaves_no_phase_and_names_what_it_holds():
    (res,) = results("failed_transitions", world=1)
    nothing = {"phase_open": False, "held": [], "watched": 0, "guard_installed": False}
    assembly = res["assembly"]  # the guard was watching groups no worker would ever suspend
    assert assembly.pop("error") == "RuntimeError: path_of exploded"
    assert not any(assembly.pop("suspended").values())  # none was suspended
    assert assembly == nothing
    begin = res["begin"]  # every suspend ran, then the store failed: they stay, named
    assert begin["error"].startswith("TransitionError: begin('rollout') failed: store connection "
                                     "lost No phase is active; this rank still holds 'world' "
                                     "(suspended), 'dp' (suspended), 'ep' (suspended): the guard "
                                     "resumes each")
    assert begin["suspended"] == {"dp": True, "ep": True, "tp": False, "world": True}
    assert not begin["phase_open"] and begin["held"] == ["world", "dp", "ep"]
    assert res["guard_resumes"]  # the guard resumes each at its next call, as the message says
    assert res["after_guard"] == {"suspended": dict.fromkeys(begin["suspended"], False),
                                  **nothing}
    end = res["end"]  # every resume ran before the store failed: nothing held, its own error
    assert end.pop("error") == "RuntimeError: store connection lost"
    assert end.pop("suspended") == dict.fromkeys(begin["suspended"], False)
    assert end == nothing
    device = res["device"]
    assert device.pop("error").startswith("OptionError: device=2147483647, but this process "
                                          "sees ")
    assert device.pop("set_up") is False and device == nothing and res["exact"]


# --- the Megatron launcher refuses a flag of ours it does not know -----------------------

@pytest.mark.parametrize("argv, message", [
    (["--rl-amem-offload-during-rolout"],
     "unknown flag --rl-amem-offload-during-rolout: did you mean "
     "--rl-amem-offload-during-rollout?"),
    (["--rl-amem-offload"], "unknown flag --rl-amem-offload: did you mean "
                            "--rl-amem-offload-during-rollout?"),
    (["--rl-amem-keep", ""], "unknown flag --rl-amem-keep: did you mean --rl-amem-keep-groups?"),
    (["--rl-amem-zzz=1"], "unknown flag --rl-amem-zzz: the flags are --rl-amem-backend, "),
    (["--rl-amem-keep-groups", ""], "argument --rl-amem-keep-groups: give one or more group "
                                    "roles, e.g. dp,world"),
    (["--rl-amem-kv-cache-margin-gb", ""], "must be a number of GB >= 0 and <= 1048576"),
])
def test_the_launcher_refuses_unknown_or_empty_flags_before_the_script_runs(argv, message,
                                                                            capsys, tmp_path):
    from amem_callbacks.adapters.megatron.__main__ import main

    ran = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    with pytest.raises(SystemExit) as exit_:
        main([str(script), "--rl-amem-offload-during-rollout", *argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and message in err, err
    assert not ran.exists()


# --- metrics(): what a user logging after each phase needs, the same keys everywhere -----

def test_metrics_say_inert_and_pending_and_give_the_last_finished_begin_and_end():
    for res in results("metrics_keys"):
        assert res["before"]["amem/inert"] == 0 and res["before"]["amem/pending"] == 0
        assert not any(k.startswith(("amem/begin/", "amem/end/")) for k in res["before"])
        right_after = res["right_after"]  # the overlapped end may still run: said, not hidden
        assert right_after["amem/pending"] in (0, 1)
        if right_after["amem/pending"] == 0:
            assert right_after["amem/end/number"] == 2
        assert right_after["amem/begin/number"] >= 1  # the first phase's figures at least
        settled = res["settled"]
        assert settled["amem/pending"] == 0 and settled["amem/inert"] == 0
        assert settled["amem/begin/number"] == settled["amem/end/number"] == 2
        assert settled["amem/total/begins"] == settled["amem/total/ends"] == 2
        session_only = {k for k in res["session"] if k.startswith("amem/total/caller_wait_")}
        assert len(session_only) == 3
        session_only.add("amem/total/begins_not_needed")  # a session's own skipped begins
        session_only.add("amem/total/begins_after_short_allocation")  # and those made after all
        assert res["session"]["amem/total/begins_not_needed"] == 0
        assert res["session"]["amem/total/begins_after_short_allocation"] == 0
        assert set(res["session"]) - session_only == set(settled)  # the same keys as plain torch


def test_a_dry_run_names_per_group_what_it_would_do():
    for res in results("metrics_keys"):
        settled = res["settled"]
        assert settled["amem/begin/groups_suspended"] == 0  # nothing was: it is a dry run
        assert settled["amem/begin/groups_would_suspend"] == 3
        assert settled["amem/end/groups_would_resume"] == 3
        for name in ("world", "dp", "ep"):
            assert settled[f"amem/begin/group/{name}/would_suspend"] == 1
            assert settled[f"amem/end/group/{name}/would_resume"] == 1
        assert not any("/group/tp/" in k for k in settled)  # kept: nothing would happen to it


@needs_modules("trl")
def test_one_process_under_trl_is_told_there_is_nothing_to_free_not_to_init():
    (res,) = results("trl_single_process", world=1, timeout=300)
    assert not res["distributed"] and res["steps"] == 2
    said = [line for line in res["lines"] if "begin('rollout')" in line[1]]
    assert len(said) == 1, res["lines"]  # once, not at every generation
    level, message = said[0]
    assert level == "INFO" and "a single process" in message
    assert "no NCCL communicator to free" in message and "init_process_group" not in message
    assert res["skipped"] == message.split(": ", 2)[2]
    assert res["amem_keys"] == [] and res["active"] is False and res["watched"] == 0


def test_a_launched_rank_without_init_is_told_to_init(monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with caplog.at_level("INFO", logger="amem_callbacks"):
        report = OffloadPolicy(backend="noop").begin("rollout")
    assert "this process of a 4-process job (WORLD_SIZE): call init_process_group" in \
        report.skipped
    assert [r.levelname for r in caplog.records] == ["WARNING"]


# --- the dry run tells the truth ----------------------------------------------------------

@pytest.mark.parametrize("tool", ["demo", "bench"])
def test_a_named_backend_that_cannot_work_here_stops_the_tool_in_one_line(tool, tmp_path):
    out = cli(tool, "--backend", "nccl", "--out", str(tmp_path), env=CPU_ONLY)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines == [f"amem-callbacks {tool}: --backend nccl needs GPUs with NCCL and this "
                     "machine has none: leave --backend out for the CPU dry run (noop)"], out.stderr
    assert out.stdout == "" and os.listdir(tmp_path) == []  # no rank started, nothing written


def test_the_demo_table_keeps_a_long_inert_reason_out_of_its_columns(capsys):
    from amem_callbacks.report import TransitionReport
    from amem_callbacks.states import Kind
    from amem_callbacks.tools.demo_report import print_table

    why = "nccl: no NCCL library is loaded in this process " * 8  # ~400 characters
    skipped = TransitionReport(phase="rollout", kind=Kind.BEGIN, backend="noop", skipped=why)
    # what the table reads of the policy: its metrics (amem/inert); the rest is in the rows
    policy = type("Inert", (), {"metrics": lambda self, prefix="amem/", last=True:
                                {"amem/inert": 1, "amem/pending": 0}})()
    print_table([(0, 0.5, skipped, skipped, [0, 0], None)], policy)
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.strip().startswith("0 "))
    assert "skipped" in row and "NCCL" not in row and len(row) < 120
    assert f"  why: {why}" in lines  # said once, on its own line


def test_bench_says_when_it_writes_no_plot_and_why(tmp_path, monkeypatch, capsys):
    from amem_callbacks.tools import bench_report

    summary = {"dry_run": False, "mean_step_s": {"none": 1.0}, "extra_step_s": {"none": 0.0},
               "sweep": None, "figures": {}, "goals": {}, "goal_met": {},
               "config": {"full": True}, "ranks_per_gpu": 1}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    bench_report.write_outputs(summary, {"timeline": [[0.0, 2**30, "none:train"]]}, str(tmp_path))
    said = [line for line in capsys.readouterr().out.splitlines() if "plot" in line]
    assert said == ["no memory plot: matplotlib is not installed (pip install matplotlib)"]
    data = json.load(open(tmp_path / "bench.json"))
    assert data["plot"] == {"path": None,
                            "why_not": "matplotlib is not installed (pip install matplotlib)"}
    assert not (tmp_path / "bench_memory.png").exists()
    bench_report.write_outputs(summary, {"timeline": []}, str(tmp_path / "dry"))
    assert "no memory plot: a dry run samples no device memory (no GPU)" in capsys.readouterr().out


def test_a_dry_run_bench_grades_nothing_it_did_not_measure():
    from amem_callbacks.tools.bench_report import NOT_MEASURED_DRY, summarise, table

    args = type("Args", (), {"groups": 2, "steps": 2, "rollout_s": 0.1, "train_s": 0.1,
                             "grad_mib": 1, "guard_calls": 10, "full": False, "pairs": 0})()
    # the shape of a dry run's raw figures, where P2 came out as -26.7 from noise
    row = {"wall_s": 0.01, "nccl_bytes": 0, "device_freed": None}
    raw = {"modes": {m: {"step_s": [0.3, 0.3001 + i * 1e-4], "parts_s": [],
                         "reports": {"begin": [row, row]} if m != "none" else {}}
                     for i, m in enumerate(("none", "naive", "overlap"))},
           "guard": {"ratio_median": 1.02, "with_s": 1.0, "without_s": 0.98,
                     "nothing_suspended_s": 0.97},
           "bandwidth_before_GBps": 1.0, "bandwidth_after_GBps": 0.9, "overlap_workers": 4,
           "backend": "noop", "caller_progress": {"begin": {"ratio": 0.4}}}
    summary = summarise(raw, args, 2, dry_run=True)
    for name, why in NOT_MEASURED_DRY.items():
        assert summary["figures"][name] is None and summary["not_measured"][name] == why
    assert summary["figures"]["P3"] == 1.02  # the guard's own cost is measured on CPU too
    shown = {line.split()[0]: line for line in table(summary).splitlines()
             if line.startswith(("P", "recreate", "learn"))}
    assert "not measured" in shown["P2"] and "noise" in shown["P2"]
    assert "not measured" not in shown["P3"] and "1.020" in shown["P3"]
    real = summarise(raw, args, 2, dry_run=False)
    assert real["not_measured"] == {} and real["figures"]["P4"] == pytest.approx(0.9)


# --- doctor, the example, the docs --------------------------------------------------------

def test_doctor_reports_a_missing_amem_library_as_a_problem_with_the_fix():
    out = cli("doctor", "--json", "--no-probe", "--amem-library", "/nonexistent.so",
              env=CPU_ONLY)
    report = json.loads(out.stdout)
    problem = next(p for p in report["problems"] if "/nonexistent.so" in p["what"])
    assert problem["what"] == "--amem-library /nonexistent.so: no such file"
    assert "the path of AMem's patched libnccl.so.2" in problem["fix"]
    assert report["facts"]["amem_library_exists"] is False
    assert "LD_LIBRARY_PATH=/:" not in out.stdout  # the folder of a file that is not there


@needs_modules("trl", "datasets")  # the example's own imports
def test_the_trl_example_overlaps_by_default_as_the_callback_does():
    import importlib.util

    from amem_callbacks.adapters.trl import AMemCallback

    spec = importlib.util.spec_from_file_location("trl_grpo_example",
                                                  os.path.join(ROOT, "examples", "trl_grpo.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    default = inspect.signature(AMemCallback).parameters["overlap"].default
    assert default is True
    assert example.build_parser().parse_args([]).overlap is default
    assert example.build_parser().parse_args(["--no-overlap"]).overlap is False


def test_docs_verl_table_holds_every_key_in_one_table():
    from amem_callbacks.adapters._verl_config import OPTIONS

    text = open(os.path.join(ROOT, "docs", "verl.md")).read()
    table = re.search(r"^\| key \| default \| what \|\n\|---\|---\|---\|\n((?:\|.*\n)+)", text,
                      re.M).group(1)
    keys = [re.match(r"\| `(\w+)` \|", row).group(1) for row in table.splitlines()]
    assert keys == list(OPTIONS)
    assert text.count("| `guard` |") == 1


def test_a_phase_whose_body_raised_is_resumed_by_the_next_begin_not_suspended_twice():
    for res in results("phase_body_raises"):
        assert res["after_raise"] == {"phase_open": False, "suspended": {
            "dp": True, "ep": True, "tp": False, "world": True}}
        assert res["dp_exact"]
        assert res["next_phase"] == {"world": "suspended", "dp": "suspended", "ep": "suspended",
                                     "tp": "kept"}
        assert res["failures"] == 0
        assert res["after"] == {"dp": False, "ep": False, "tp": False, "world": False}
        assert res["exact"] and res["learned"] == {}
        assert res["end"] == {"phase_open": False, "held": [], "watched": 0,
                              "guard_installed": False}
