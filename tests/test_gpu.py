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
    if run.returncode != 0:  # pytest shows this output in its log: the evidence survives
        for name, row in summary["suites"].items():  # the temporary folder
            if row["ok"] is False:
                print(f"--- {name}: exit {row.get('exit_code')}, last output:\n{row.get('tail')}")
        for path, failed in failed_checks(out):
            print(f"--- {os.path.relpath(path, out)}: failed checks {failed}")
    assert run.returncode == 0, sorted(k for k, v in summary["suites"].items() if v["ok"] is False)


def failed_checks(folder: str) -> list:
    """(JSON file, names of its false checks) for every result under ``folder``."""
    found = []
    for where, _dirs, files in os.walk(folder):
        for name in sorted(f for f in files if f.endswith(".json")):
            path = os.path.join(where, name)
            try:
                data = json.load(open(path))
            except (OSError, ValueError):
                continue
            false = sorted(_false_checks(data))
            if false:
                found.append((path, false))
    return found


def _false_checks(node, prefix: str = "") -> set:
    out = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "checks" and isinstance(value, dict):
                out.update(f"{prefix}{k}" for k, v in value.items() if v is False)
            elif isinstance(value, (dict, list)):
                out |= _false_checks(value, f"{prefix}{key}/")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out |= _false_checks(value, f"{prefix}{i}/")
    return out
