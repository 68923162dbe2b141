"""Real-NCCL checks; they run only where two CUDA GPUs are visible (see conftest)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, out: str, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    os.path.join(ROOT, "tests", "gpu", script), out, *args],
                   check=True, env=env, timeout=900)


@pytest.mark.gpu
def test_core_engine_on_real_nccl(tmp_path):
    out = str(tmp_path / "core.json")
    torchrun("core_gpu.py", out, "50")
    for rank in range(2):
        result = json.load(open(out.replace(".json", f".rank{rank}.json")))
        assert result["ok"], result["checks"]


@pytest.mark.gpu
def test_reliability_suite_on_real_nccl(tmp_path):
    out = str(tmp_path / "reliability.json")
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "reliability_gpu.py"), out],
                   env=dict(os.environ, PYTHONPATH=ROOT), timeout=1800)
    result = json.load(open(out))
    assert result["complete"] and result["ok"], [r for r in result["cases"] if r["ok"] is False]
