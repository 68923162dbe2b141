"""The bench runs on CPU as a dry run and its report is well-formed and consistent.
(Timings are never asserted: they are measurements, not properties.) The run is
asked for its CPU dry run explicitly (CUDA_VISIBLE_DEVICES=""), so this file
means the same on a machine with a GPU."""

import io
import json
import os
import subprocess
import sys

import pytest

from amem_callbacks.tools import bench_stages
from amem_callbacks.tools.cli import build_parser


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run(
        [sys.executable, "-m", "amem_callbacks.tools.cli", "bench", "--steps", "2",
         "--rollout-s", "0.1", "--train-s", "0.02", "--guard-calls", "200", "--groups", "8", "--out", str(out),
         "--modes", "none,naive,overlap,recreate"],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))  # the CPU dry run, GPU or not
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.load(open(out / "bench.json"))


def test_dry_run_says_so_and_prints_one_table(bench):
    run, _ = bench
    assert "dry run on 2 CPU processes with the noop backend" in run.stdout
    assert run.stdout.count("mean step s") == 1
    assert "DRY RUN step times" in run.stdout and "DRY RUN figures" in run.stdout
    figures = run.stdout[run.stdout.index("DRY RUN figures"):]
    for verdict in (" ok", "MISSED", "<=", ">=", "goal "):  # no goals or verdicts on a dry run
        assert verdict not in figures
    for figure in ("P1", "P2", "P2b", "P3", "P4", "recreate_over_overlap", "P5"):
        assert f"\n{figure} " in run.stdout


def test_results_are_printed_before_the_file_is_written(bench):
    run, report = bench
    assert run.stdout.index("DRY RUN figures") < run.stdout.index("wrote ")
    assert "results go to " in run.stdout.split("DRY RUN")[0]  # said before the run
    # the help promises a memory plot: a run without one says so, and why, once
    assert run.stdout.count("no memory plot") == 1
    assert "no memory plot: a dry run samples no device memory (no GPU)" in run.stdout
    assert report["plot"] == {"path": None,
                              "why_not": "a dry run samples no device memory (no GPU)"}


def test_figures_a_dry_run_does_not_measure_read_not_measured(bench):
    run, _ = bench
    lines = {line.split()[0]: line for line in run.stdout.splitlines()
             if line.startswith(("P1", "P2", "P3", "P4", "P5"))}
    assert "not measured" in lines["P2"] and "noise" in lines["P2"]
    assert "not measured" in lines["P1"] and "not measured" in lines["P4"]
    assert "not measured" not in lines["P3"]  # the guard's own cost is measured on CPU too


def test_one_progress_line_per_stage_with_the_time_left(bench):
    run, _ = bench
    lines = [line for line in run.stderr.splitlines() if line.startswith("bench [")]
    stages = 1 + 4 + 1 + 3  # bandwidth, the 4 modes, the pairs, guard, caller progress, bandwidth
    assert [line.split("]")[0] for line in lines] == [f"bench [{i}/{stages}" for i in
                                                      range(1, stages + 1)]
    assert all(line.endswith(" left") for line in lines[:-1]) and lines[-1].endswith("done")
    assert "stages, about" in run.stderr


def test_report_is_internally_consistent(bench):
    _, report = bench
    assert report["dry_run"] is True and report["backend"] == "noop" and report["world"] == 2
    assert set(report["mean_step_s"]) == {"none", "naive", "overlap", "recreate"}
    for mode, mean in report["mean_step_s"].items():
        assert report["extra_step_s"][mode] == pytest.approx(mean - report["mean_step_s"]["none"])
    figures = report["figures"]
    assert report["goal_met"] == {} and report["goals"] == {}
    # a dry run computes no ratio from noise: what it did not measure says so, and why
    from amem_callbacks.tools.bench_report import NOT_MEASURED_DRY

    assert report["not_measured"] == NOT_MEASURED_DRY
    assert all(figures[name] is None for name in NOT_MEASURED_DRY)
    assert report["extra_step_s"]["naive"] is not None  # the raw times are still there
    guard = report["guard"]
    assert figures["P3"] == guard["ratio_median"] and guard["pairs"] >= 8
    assert min(guard["with_s"], guard["without_s"]) > 0
    assert report["bandwidth_GBps"][0] > 0
    for mode, parts in report["mean_parts_s"].items():  # the parts fit inside the step
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) <= report["mean_step_s"][mode]
    assert figures["P1"] is None  # nothing is freed in a dry run: no made-up figure
    assert figures["P1_overlap"] is None


def test_every_step_of_both_policy_modes_moved_the_same_groups(bench):
    _, report = bench
    for mode in ("naive", "overlap"):
        begins = report["reports"][mode]["begin"]
        assert len(begins) == 2 and len(report["reports"][mode]["end"]) == 2
        for row in begins:
            actions = {name: action for name, (action, _s) in row["groups"].items()}
            assert actions.pop("tp") == "kept"
            assert len(actions) == 8 and set(actions.values()) == {"would suspend"}


def test_with_and_without_run_in_interleaved_pairs(bench):
    run, report = bench
    pairs = report["pairs"]
    assert report["config"]["pairs"] == 3 and len(pairs["pairs"]) == 3
    assert [p["order"] for p in pairs["pairs"]] == [["none", "overlap"], ["overlap", "none"],
                                                     ["none", "overlap"]]
    ratios = [p["results"]["overlap"]["step_s"] / p["results"]["none"]["step_s"]
              for p in pairs["pairs"]]
    assert pairs["ratios"] == pytest.approx(ratios)
    assert report["figures"]["step_ratio_pairs"] == pytest.approx(sorted(ratios)[1])
    assert pairs["spread"] == pytest.approx([min(ratios), max(ratios)])
    assert all(len(p["results"][side]["steps_s"]) == 2 for p in pairs["pairs"]
               for side in ("none", "overlap"))
    assert "interleaved pairs, step time overlap / none: median" in run.stdout
    control = pairs["control"]  # the baseline once more, after the pairs
    assert control["name"] == "none" and len(control["result"]["steps_s"]) == 2
    baselines = sorted(p["results"]["none"]["step_s"] for p in pairs["pairs"])
    assert pairs["control_over_baseline"] == pytest.approx(
        control["result"]["step_s"] / baselines[1])
    assert "control (none, after the pairs) / the pairs' none:" in run.stdout


def _resolved(*argv):
    return bench_stages.resolve(build_parser().parse_args(["bench", *argv]))


def test_the_default_is_the_quick_run_and_full_is_the_old_sweep():
    quick = _resolved()
    assert (quick.modes, quick.groups, quick.steps, quick.sweep, quick.guard_calls) == (
        ("none", "naive", "overlap"), 2, 2, [], 1200)
    full = _resolved("--full")
    assert (full.modes, full.groups, full.steps, full.sweep, full.guard_calls) == (
        ("none", "naive", "overlap", "recreate"), 8, 4, [1, 2, 4, 8], 12000)
    mixed = _resolved("--full", "--steps", "3", "--sweep", "")
    assert (mixed.steps, mixed.sweep, mixed.groups) == (3, [], 8)  # explicit beats the preset


def test_quick_sets_small_nccl_buffers_unless_the_user_chose_them():
    assert bench_stages.buffer_env(False, {}) == {"NCCL_BUFFSIZE": "1048576",
                                                  "NCCL_MAX_NCHANNELS": "4"}
    assert bench_stages.buffer_env(False, {"NCCL_BUFFSIZE": "4194304"}) == {
        "NCCL_MAX_NCHANNELS": "4"}
    assert bench_stages.buffer_env(True, {}) == {}


def test_the_quick_plan_fits_in_90_seconds_where_the_full_one_did_not(monkeypatch):
    """Against the README's one-H200 figures: ~0.4 s per transition with small
    buffers, 3-6 s per suspend of a 1.15 GB communicator with NCCL's defaults."""
    monkeypatch.setenv("NCCL_BUFFSIZE", "1048576")
    quick = sum(s for _, s in bench_stages.plan(_resolved(), on_gpu=True, workers=4))
    assert quick < 60  # rank start-up and CUDA init come on top
    monkeypatch.delenv("NCCL_BUFFSIZE")
    full = sum(s for _, s in bench_stages.plan(_resolved("--full"), on_gpu=True, workers=4))
    assert full > 300


def test_the_time_left_follows_the_stages_that_really_ran(monkeypatch):
    clock = iter([0.0, 10.0, 30.0, 0.0, 1.0])  # start, then each stage's end
    monkeypatch.setattr(bench_stages.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    stages = bench_stages.Stages([("a", 5.0), ("b", 5.0), ("c", 10.0)], enabled=True, out=out)
    stages.finished("a")  # took 10 s for 5 planned: twice as slow as planned
    stages.finished("b")
    assert out.getvalue().splitlines() == [
        "bench: 3 stages, about 20 s (first estimate)",
        "bench [1/3] a: 10.0 s; about 30 s left",
        "bench [2/3] b: 20.0 s; about 30 s left"]
    quiet = io.StringIO()
    bench_stages.Stages([("a", 1.0)], enabled=False, out=quiet).finished("a")
    assert quiet.getvalue() == ""



def _summary(dry_run: bool, full: bool) -> dict:
    return {"dry_run": dry_run, "mean_step_s": {"none": 1.0}, "extra_step_s": {"none": 0.0},
            "sweep": None, "figures": {"P2": 0.05, "P4": 0.5, "P5": None},
            "goals": {} if dry_run else {"P2": "<= 0.1", "P4": ">= 0.99", "P5": ">= 0.8"},
            "goal_met": {} if dry_run else {"P2": True, "P4": False, "P5": None},
            "config": {"full": full}, "ranks_per_gpu": 1}


def test_goals_and_verdicts_appear_on_gpu_runs_only():
    from amem_callbacks.tools.bench_report import table

    real = table(_summary(dry_run=False, full=True)).splitlines()
    assert any(line.startswith("P2 ") and "<= 0.1" in line and line.endswith(" ok")
               for line in real)
    assert any(line.startswith("P4 ") and line.endswith(" MISSED") for line in real)
    assert "quick run" not in " ".join(real)
    dry = table(_summary(dry_run=True, full=False))
    assert "DRY RUN" in dry and "<=" not in dry and ">=" not in dry and "MISSED" not in dry
    assert "quick run" in table(_summary(dry_run=False, full=False))


def test_the_report_names_the_torch_backend_the_ranks_ran_on(bench):
    _, report = bench
    assert report["torch_backend"] == "gloo"  # the CPU dry run
    assert report["torch_backend_class"] is None  # no CUDA group to read a class from
    import torch

    assert report["torch"] == torch.__version__


def test_torch_backend_takes_torch_215s_names_and_refuses_others(capsys):
    for name in ("nccl", "nccl2", "nccl-lazy", "nccl-legacy"):
        assert build_parser().parse_args(["bench", "--torch-backend", name]).torch_backend == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--torch-backend", "gloo"])
    assert "nccl-lazy" in capsys.readouterr().err


def test_torch_backend_stops_before_any_rank_where_it_cannot_run(monkeypatch):
    from amem_callbacks.tools import launch

    # a CPU machine: the dry run's groups are gloo whatever the flag says
    assert "no GPU" in launch.torch_backend_refusal("nccl-lazy", on_gpu=False)
    assert launch.torch_backend_refusal(None, on_gpu=False) is None
    # a GPU machine whose torch predates the name (torch < 2.15 has no nccl-lazy)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_backend_available", lambda name: name == "nccl")
    refused = launch.torch_backend_refusal("nccl-lazy", on_gpu=True)
    assert "has no such backend" in refused and "leave it out" in refused
    assert launch.torch_backend_refusal("nccl", on_gpu=True) is None


def test_a_refused_torch_backend_stops_the_cpu_bench_in_one_line():
    run = subprocess.run(
        [sys.executable, "-m", "amem_callbacks.tools.cli", "bench", "--torch-backend",
         "nccl-lazy"], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "amem-callbacks bench: --torch-backend nccl-lazy builds NCCL groups and this machine "
        "has no GPU: leave it out for the CPU dry run (gloo)"]


def test_the_report_names_the_suspects_of_a_missed_p5():
    from amem_callbacks.tools.bench_report import suspect_lines
    progress = {"suspects": {"begin": {"calls": [[0.041, "ProcessGroupNCCL._comm_ptr", "t-1"]]},
                             "end": {"calls": []}}}
    lines = suspect_lines(progress)
    assert "  begin: ProcessGroupNCCL._comm_ptr 41 ms (t-1)" in lines
    assert "  end: none" in lines


def test_the_bench_profiles_one_more_cycle_for_suspects(bench):
    _, report = bench
    suspects = report["caller_progress"]["suspects"]
    assert set(suspects) == {"begin", "end"}
    assert all(isinstance(s["calls"], list) for s in suspects.values())


def test_the_report_says_which_commit_and_machine_made_it(bench):
    _, report = bench
    from amem_callbacks.tools import provenance

    assert report["commit"] == provenance.commit()  # this checkout's (None in an export)
    machine = report["machine"]
    assert machine["torch"] and machine["python"] and machine["card"] is None  # a dry run
