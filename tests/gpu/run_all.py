"""One command for the whole GPU suite, on 1, 2 or 8 GPUs alike.

    python -m tests.gpu.run_all --out OUT [--ranks N] [--only core,multinode]

(the committed runs: results/one_h200/*/summary.json, listed in results/README.md)

Runs each suite with N ranks (default: one per GPU, at least 2; more ranks
than GPUs share them: NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1 is set here),
writes one JSON per suite under --out and a summary.json with, per suite, the
exact command, exit code, seconds and verdict, plus torch, the loaded NCCL and
the GPUs. A suite whose framework is not installed (megatron-core, trl, verl),
or whose carried bundle is missing (``.gpu/megatron``: tests/gpu/bundle_megatron.sh),
is reported as skipped, with why. The real-loop suites (``megatron_rl``,
``verl_worker``, ``trl_fsdp2``, ``trl_hsdp``) each run baseline, amem and a
control and compare them. Preload a suspend-capable NCCL first, e.g.
``LD_PRELOAD=/tmp/nccl/libnccl.so.2`` (../shared/tools/device-nccl).

``--small-buffers`` sets NCCL_BUFFSIZE=1 MiB and NCCL_MAX_NCHANNELS=4 for the
functional suites: the behaviour is the same, the transitions of several
ranks on one GPU much shorter (fewer and smaller buffers to copy).

A suite passes only when its process exits 0 and its JSON (if it writes one)
does not say ``"ok": false``; a non-zero exit or a timeout fails it whatever
its JSON says. A skipped suite is listed as SKIP, never as passed.

Exit status: 0 every chosen suite ran and passed; 1 a suite failed (or hung);
3 none failed but some were skipped (see summary.json's "skipped"); 2 nothing
could run (no GPU, ranks refused, a bad option).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMALL_BUFFERS = {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_MAX_NCHANNELS": "4"}
# The FSDP2/HSDP loops at the size of their committed results (results/one_h200/trl_fsdp2,
# trl_hsdp, trl_hsdp_torch214):
# trl_gpu.py's default model with 384-token completions takes minutes per run on a shared GPU.
TRL_LOOP_SIZE = ["--steps", "3", "--hidden", "256", "--layers", "2", "--completion-length", "64",
                 "--batch", "4"]


def suites(ranks: int, out: str, cycles: int) -> dict:
    """name -> (command, needs module or None, result file)."""
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    j = lambda name: os.path.join(out, f"{name}.json")  # noqa: E731
    return {
        "doctor": ([py, "-m", "amem_callbacks.tools.cli", "doctor", "--json"], None, None),
        "core": (torchrun + ["tests/gpu/core_gpu.py", j("core"), str(cycles)], None, j("core")),
        "reliability": ([py, "tests/gpu/reliability_gpu.py", j("reliability")], None,
                        j("reliability")),
        "multinode": ([py, "tests/gpu/multinode_gpu.py", j("multinode"), "--ranks", "8"], None,
                      j("multinode")),
        "multinode_tp_in_node": ([py, "tests/gpu/multinode_gpu.py", j("multinode_tp_in_node"),
                                  "--ranks", "8", "--ranks-per-node", "2"], None,
                                 j("multinode_tp_in_node")),
        "demo": ([py, "-m", "amem_callbacks.tools.cli", "demo", "--ranks", str(ranks),
                  "--steps", "3"], None, None),
        "bench_touch": ([py, "-m", "amem_callbacks.tools.cli", "bench", "--ranks", str(ranks),
                         "--full", "--groups", "4", "--steps", "3", "--rollout-s", "2",
                         "--train-s", "0.5",
                         "--modes", "none,touch,touch-nolearn", "--sweep", "",
                         "--guard-calls", "2400", "--out", os.path.join(out, "bench_touch")],
                        None, os.path.join(out, "bench_touch", "bench.json")),
        "megatron": (torchrun + ["tests/gpu/megatron_gpu.py", j("megatron")], "megatron.core",
                     j("megatron")),
        "trl": (torchrun + ["tests/gpu/trl_gpu.py", j("trl")], "trl", j("trl")),
        "trl_fsdp2": (torchrun + ["tests/gpu/trl_gpu.py", j("trl_fsdp2"), "--fsdp2",
                                  *TRL_LOOP_SIZE], "trl", j("trl_fsdp2")),
        "trl_hsdp": ([py, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                      "tests/gpu/trl_gpu.py", j("trl_hsdp"), "--hsdp", *TRL_LOOP_SIZE], "trl",
                     j("trl_hsdp")),
        "verl_worker": (["bash", "tests/gpu/verl_gpu.sh", os.path.join(out, "verl_worker")],
                        "verl", os.path.join(out, "verl_worker", "summary.json")),
        "megatron_rl": (["bash", "tests/gpu/megatron_rl_gpu.sh", os.path.join(out, "megatron_rl"),
                         str(ranks)], ".gpu/megatron",
                        os.path.join(out, "megatron_rl", "summary.json")),
    }


def _missing(needs) -> object:
    """Why a suite cannot run here, or None: a module not installed, a bundle not carried."""
    if not needs:
        return None
    if needs.startswith("."):
        return None if os.path.isdir(os.path.join(ROOT, needs)) else \
            f"{needs} is not here (make it with tests/gpu/bundle_*.sh and carry it)"
    return None if _safe_find_spec(needs) else f"{needs} is not installed here"


EXIT_PASSED, EXIT_FAILED, EXIT_NOT_RUN, EXIT_SKIPPED = 0, 1, 2, 3


def _safe_find_spec(name: str):
    """find_spec that says None for "a.b" when "a" is missing (it raises there)."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def judge(exit_code, verdict) -> bool:
    """A suite passed: its process exited 0 and its JSON, if any, does not say it failed."""
    return exit_code == 0 and verdict is not False


def status_of(row: dict) -> str:
    return "SKIP" if row.get("skipped") else "PASS" if row.get("ok") else "FAIL"


def exit_status(rows: dict) -> int:
    """See the module docstring: failed beats skipped beats passed."""
    states = {status_of(row) for row in rows.values()}
    if "FAIL" in states:
        return EXIT_FAILED
    return EXIT_SKIPPED if "SKIP" in states else EXIT_PASSED


def run_suite(command: list, result, env: dict, timeout: int, runner=None) -> dict:
    """One suite's row: exit code, output tail, seconds, ok (``runner``: subprocess.run)."""
    row = {"command": " ".join(command)}
    if result and os.path.exists(result):
        os.remove(result)  # an earlier run's verdict must not stand in for this one's
    start = time.monotonic()
    try:
        run = (runner or subprocess.run)(command, cwd=ROOT, env=env, capture_output=True,
                                         text=True, timeout=timeout)
        row.update(exit_code=run.returncode, tail=(run.stdout + run.stderr)[-3000:],
                   stdout=run.stdout)
    except subprocess.TimeoutExpired as exc:
        row.update(exit_code=None, hung_past_s=timeout, tail=str(exc.stdout or "")[-2000:])
    row["seconds"] = round(time.monotonic() - start, 1)
    verdict = _verdict(result)
    if verdict is not None:
        row["json_ok"] = verdict
    row["ok"] = judge(row["exit_code"], verdict)
    return row


def _verdict(path) -> object:
    if not path or not os.path.exists(path):
        return None
    try:
        data = json.load(open(path))
    except (OSError, ValueError):
        return None
    return data.get("ok") if isinstance(data, dict) else None


def main(argv=None) -> int:
    from amem_callbacks.tools.cli import ranks

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="exit status: 0 all chosen suites ran and passed; 1 a suite failed; 3 none "
               "failed but some were skipped; 2 nothing could run")
    parser.add_argument("--out", required=True, help="folder for each suite's JSON and "
                                                     "summary.json")
    parser.add_argument("--ranks", type=ranks, default=None,
                        help="ranks per suite (default: one per GPU, at least 2)")
    parser.add_argument("--only", default="", help="comma list of suites (default: all)")
    parser.add_argument("--cycles", type=int, default=5, help="core suite's begin/end cycles")
    parser.add_argument("--small-buffers", action="store_true",
                        help="NCCL_BUFFSIZE=1 MiB, NCCL_MAX_NCHANNELS=4: shorter transitions")
    parser.add_argument("--timeout", type=int, default=900, help="per suite, seconds")
    args = parser.parse_args(argv)

    import torch

    from amem_callbacks.nccl_library import NcclLibrary
    from amem_callbacks.tools.launch import plan_ranks
    from tests.gpu.common import run_commit

    layout = plan_ranks(args.ranks)
    if layout.refused or not layout.on_gpu:
        print(layout.refused or "no GPU here: the GPU suite needs CUDA")
        return EXIT_NOT_RUN
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, **layout.env, AMEM_GPU_QUICK="1" if layout.ranks_per_gpu > 1 else "0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.small_buffers:
        env.update(SMALL_BUFFERS)
    table = suites(layout.ranks, args.out, args.cycles)
    chosen = [n for n in args.only.split(",") if n] or list(table)
    unknown = sorted(set(chosen) - set(table))
    if unknown:
        parser.error(f"unknown suite(s) {unknown}: choose from {sorted(table)}")
    lib = NcclLibrary.loaded()
    summary = {"command": "python -m tests.gpu.run_all " + " ".join(sys.argv[1:] if argv is None
                                                                    else argv),
               "commit": run_commit(),
               "torch": torch.__version__, "nccl_loaded": lib.version_str if lib else None,
               "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
               "ranks": layout.ranks, "ranks_per_gpu": layout.ranks_per_gpu,
               "env": {k: env.get(k) for k in ("LD_PRELOAD", "NCCL_MULTI_RANK_GPU_ENABLE",
                                               "NCCL_BUFFSIZE", "NCCL_MAX_NCHANNELS",
                                               "AMEM_GPU_QUICK", "TORCH_DIST_USE_NCCL2",
                                               "AMEM_GPU_PG_BACKEND")},
               "suites": {}}
    for name in chosen:
        command, needs, result = table[name]
        why_not = _missing(needs)
        if why_not:
            row = {"command": " ".join(command), "ok": None, "skipped": why_not}
        else:
            row = run_suite(command, result, env, args.timeout)
            stdout = row.pop("stdout", "")
            if name == "doctor":
                try:
                    row["doctor"] = json.loads(stdout)
                except ValueError:
                    row["doctor"] = None
        summary["suites"][name] = row
        summary["skipped"] = sorted(n for n, r in summary["suites"].items() if r.get("skipped"))
        print(f"{name:22} {status_of(row)}  {row.get('seconds', 0):7.1f} s"
              + (f"  ({row['skipped']})" if row.get("skipped") else ""), flush=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return exit_status(summary["suites"])


if __name__ == "__main__":
    sys.exit(main())
