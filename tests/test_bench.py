"""The bench runs on CPU as a dry run and its report is well-formed and consistent.
(Timings are never asserted: they are measurements, not properties.)"""

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run(
        [sys.executable, "-m", "amem_callbacks.tools.cli", "bench", "--steps", "2", "--rollout-s", "0.1",
         "--train-s", "0.02", "--guard-calls", "200", "--groups", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.load(open(out / "bench.json"))


def test_dry_run_says_so_and_prints_one_table(bench):
    run, _ = bench
    assert "dry run on 2 CPU processes with the noop backend" in run.stdout
    assert run.stdout.count("mean step s") == 1
    assert " ok" not in run.stdout and "MISSED" not in run.stdout  # no verdicts on a dry run
    for figure in ("P1", "P2", "P2b", "P3", "P4", "recreate_over_overlap", "P5"):
        assert f"\n{figure} " in run.stdout


def test_report_is_internally_consistent(bench):
    _, report = bench
    assert report["dry_run"] is True and report["backend"] == "noop" and report["world"] == 2
    assert set(report["mean_step_s"]) == {"none", "naive", "overlap", "recreate"}
    for mode, mean in report["mean_step_s"].items():
        assert report["extra_step_s"][mode] == pytest.approx(mean - report["mean_step_s"]["none"])
    figures = report["figures"]
    assert set(report["goal_met"].values()) == {None}
    assert figures["P2"] == pytest.approx(report["extra_step_s"]["overlap"]
                                          / report["extra_step_s"]["naive"])
    assert figures["P2b"] == pytest.approx(report["begin_to_memory_free_s"]["overlap"]
                                           / report["begin_to_memory_free_s"]["naive"])
    guard = report["guard"]
    assert figures["P3"] == guard["ratio_median"] and guard["pairs"] >= 8
    assert min(guard["with_s"], guard["without_s"]) > 0
    assert figures["P3_state"] == pytest.approx(guard["without_s"] / guard["nothing_suspended_s"])
    before, after = report["bandwidth_GBps"]
    assert figures["P4"] == pytest.approx(after / before)
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
