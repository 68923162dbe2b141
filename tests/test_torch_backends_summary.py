"""tests/gpu/torch_backends_summary.py on folders shaped like its GPU script's: a backend
passes only when every part passed, and a failing part is named with its figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.gpu import torch_backends_summary as tbs  # noqa: E402


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data))


def _backend(folder, p5=0.95, core_ok=True, probe_ok=True, full=False):
    _write(f"{folder}/summary.json", {
        "torch": "2.15.0+cu132", "commit": "abc", "nccl_loaded": "2.30.7", "gpus": ["H100"],
        "env": {}, "suites": {"doctor": {"ok": True}, "core": {"ok": core_ok}}})
    for rank in (0, 1):
        _write(f"{folder}/core.rank{rank}.json", {
            "checks": {"ctypes_path": True, "caller_progress_ge_0.8": core_ok},
            "first_begin": {"paths": ["ctypes"], "freed": 100, "freed_expected": 100},
            "caller_progress": {"begin": {"ratio": 0.9}}})
    # NCCL's own INFO lines may come first on the probe's stdout
    _write(f"{folder}/probe.json", "NCCL INFO x\n" + json.dumps(
        {"class": "ProcessGroupNCCL2", "path": "ctypes", "ok": probe_ok,
         **({} if probe_ok else {"error": "RuntimeError: no pointer"})}) + "\n")
    bench = {"torch": "2.15.0+cu132", "torch_backend_class": "ProcessGroupNCCL2",
             "figures": {"P1": 1.0, "P5": p5, "P5_end": 0.97, "P6": 0.2, "P6_off": 1.0},
             "reports": {"naive": {"begin": [{"wall_s": 0.3}], "end": [{"wall_s": 0.2}]}},
             "config": {"nccl_buffsize": "1048576"}}
    _write(f"{folder}/bench/bench.json", bench)
    if full:
        _write(f"{folder}/bench_full/bench.json", bench)


def test_every_backend_that_passed_every_part_passes(tmp_path):
    for name in ("nccl", "nccl-lazy", "nccl-legacy"):
        _backend(str(tmp_path / name), full=name == "nccl")
    result = tbs.summarise(str(tmp_path))
    assert result["ok"] and sorted(result["backends"]) == ["nccl", "nccl-lazy", "nccl-legacy"]
    row = result["backends"]["nccl"]
    assert row["probe"]["class"] == "ProcessGroupNCCL2" and row["core"]["paths"] == ["ctypes"]
    assert row["bench_full"]["P6"] == 0.2 and not result["backends"]["nccl-lazy"]["bench_full"]["ran"]


def test_a_failing_part_fails_its_backend_and_says_which(tmp_path):
    _backend(str(tmp_path / "nccl"), p5=0.05)  # torch's own GIL-holding suspend
    _backend(str(tmp_path / "nccl-lazy"), core_ok=False, probe_ok=False)
    run = subprocess.run([sys.executable, "tests/gpu/torch_backends_summary.py", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 1
    assert "bench: P5 0.05 < 0.8" in run.stdout
    assert "core: failed" in run.stdout and "core check caller_progress_ge_0.8" in run.stdout
    assert "probe: RuntimeError: no pointer" in run.stdout
    saved = json.load(open(tmp_path / "backends.json"))
    assert not saved["ok"] and not saved["backends"]["nccl"]["ok"]


def test_a_folder_without_results_fails_rather_than_passing_empty(tmp_path):
    os.makedirs(tmp_path / "nccl")
    row = tbs.summarise(str(tmp_path))["backends"]["nccl"]
    assert not row["ok"] and "run_all: no summary.json" in row["failed"]
    assert not tbs.summarise(str(tmp_path / "nccl"))["ok"]  # no backend folders at all


def test_the_gpu_script_parses():
    subprocess.run(["bash", "-n", "tests/gpu/torch_backends_gpu.sh"], cwd=ROOT, check=True)
    subprocess.run(["bash", "-n", "tests/gpu/bundle_torch.sh"], cwd=ROOT, check=True)
    subprocess.run(["bash", "-n", "tests/gpu/bundle_verl_e2e.sh"], cwd=ROOT, check=True)


def test_the_gpu_script_runs_every_backend_this_torch_has_and_fails_here_without_a_gpu(
        tmp_path):
    # CPU: each step refuses (no CUDA), and the script still reaches its summary, which
    # names every backend as failed: what a GPU host without a usable NCCL would see
    import torch.distributed as dist

    run = subprocess.run(["bash", "tests/gpu/torch_backends_gpu.sh", str(tmp_path), "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280,
                         env=dict(os.environ, SKIP_FULL="1", CUDA_VISIBLE_DEVICES=""))
    expected = ["nccl", "nccl-legacy"] + (["nccl-lazy"] if dist.is_backend_available(
        "nccl-lazy") else [])
    assert sorted(os.listdir(tmp_path)) == sorted(expected + ["backends.json", "backends.txt"])
    assert "rc 127" not in run.stdout  # every command line was well formed
    saved = json.load(open(tmp_path / "backends.json"))
    assert not saved["ok"] and all("run_all: no summary.json" in row["failed"]
                                   for row in saved["backends"].values())
