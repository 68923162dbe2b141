"""Mutation check: with the fake NCCL's tripwire, the suite turns red when the
guard lets a call through or when a resume is skipped; and the GPU drivers' CPU
runs turn red when the package renames what a driver reads.

Each mutation (tests/mutations.py) is applied inside the rank processes by
``python -m tests.scenarios``, or by tests/gpu/common.py in the drivers' CPU
mode (environment variable ``AMEM_TEST_MUTATE``); the package has no hook for
it. Without a mutation the same scenarios and drivers pass
(tests/test_gpu_drivers_on_cpu.py).
"""

import os
import re

import pytest

from tests.fake_nccl.tripwire import EXIT_CODE, MARKER
from tests.harness import run_ranks
from tests.mutations import ENV
from tests.test_gpu_drivers_on_cpu import start_core

REPRESENTATIVE = "tests.scenarios_fake_nccl:representative"


def run(scenario, mutation=None, **args):
    env = {ENV: mutation or ""}  # "": unmutated even if the caller's environment names one
    return run_ranks(scenario, args=args, env=env, expect_ok=mutation is None,
                     allow_fake_nccl_fatal=mutation is not None)


def assert_killed_on(ranks, mutation, group, op="c10d::allreduce_"):
    """The run failed because a collective reached a suspended communicator:
    a rank died there with the tripwire's line naming the call and the group.
    Its peers fail too (they die on the same call, or lose the dead rank: the
    store or the collective's connection), as a real NCCL crash takes the job
    down; none returns a result."""
    expected = f"{MARKER}: {op} on group {group!r}"
    for r in ranks:
        # the whole log: a long traceback can push the line out of the tail
        assert f"MUTATION applied: {mutation}" in open(r["log_path"], errors="replace").read()
        assert r["returncode"] != 0 and "result" not in r, r["log"]
        assert [line.split(" (")[0] for line in r["fake_nccl_fatal"]] in ([], [expected]), r["log"]
    killed = [r for r in ranks if r["fake_nccl_fatal"]]
    assert killed and all(r["returncode"] == EXIT_CODE for r in killed)


def test_the_representative_scenario_passes_unmutated():
    for r in run(REPRESENTATIVE):
        res = r["result"]
        assert res["mutation"] == ""
        assert res["during"] == {"dp": True, "ep": True, "tp": False, "world": True}
        assert res["tp_during"] and res["dp_during"] and res["exact_after"]
        assert "resumed by the guard" in res["end"]["groups"]["dp"][1]
        assert not any(res["after"].values())
        assert r["fake_nccl_fatal"] == []


@pytest.mark.parametrize("mutation,group", [
    ("guard-off", "dp"),  # the guard lets the rollout's call on dp through
    ("skip-resume:dp", "dp"),  # the guard's resume of dp is skipped
    ("skip-resume:ep", "ep"),  # end()'s resume of ep is skipped: the first call after end
])
def test_the_representative_scenario_dies_under_each_mutation(mutation, group):
    assert_killed_on(run(REPRESENTATIVE, mutation), mutation, group)


@pytest.mark.parametrize("scenario,args,mutation,group", [
    ("guard", {}, "guard-off", "dp"),
    ("fake_cycle", {"cycles": 1}, "skip-resume:dp", "dp"),
])
def test_existing_scenarios_of_the_suite_turn_red_too(scenario, args, mutation, group):
    assert_killed_on(run(scenario, mutation, **args), mutation, group)


def test_core_gpu_on_cpu_fails_when_the_package_renames_a_view_field(tmp_path):
    """The bug CI missed: core_gpu.py read a name the package no longer had, and
    failed on every GPU host. Renamed here in the package (the engine builds
    GroupView with the new name), its CPU run fails on the read of the old one."""
    mutation = "rename-view-field:nccl_suspended=nccl_reports_suspended"
    run = start_core(str(tmp_path), mutation=mutation)
    codes = run.wait()
    assert not run.hung and all(code != 0 for code in codes), (codes, run.output())
    for log in run.logs:
        text = open(log, errors="replace").read()
        assert f"MUTATION applied: {mutation}" in text, text[-3000:]
    text = run.output()
    error = "AttributeError: 'GroupView' object has no attribute 'nccl_suspended'"
    assert error in text, text
    frames = re.findall(r'File "([^"]+)", line \d+', text.split(error)[0])
    assert frames[-1].endswith(os.path.join("tests", "gpu", "core_gpu.py")), text  # the read
