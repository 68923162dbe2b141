"""Real-NCCL checks; they run only where CUDA sees a GPU (see conftest): the
whole GPU suite through its one runner, with as many ranks as fit."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.gpu
@pytest.mark.timeout(1800)  # not the project's 300 s: core, multinode and reliability on
def test_gpu_suite(tmp_path):  # one H200 take about 5 min (the fault cases: 40-70 s each)
    out = str(tmp_path / "gpu")
    run = subprocess.run([sys.executable, "-m", "tests.gpu.run_all", "--out", out,
                          "--small-buffers", "--only", "core,multinode,reliability"],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=3600)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert run.returncode == 0, {k: v.get("tail") for k, v in summary["suites"].items()
                                 if v["ok"] is False}
