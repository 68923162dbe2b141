"""Megatron-LM's RL loop in the configurations real jobs use, with and without
the package: does anything crash or hang, does any collective reach a
suspended group, what is suspended, losses side by side.

    python3 tests/gpu/megatron_matrix.py OUT [--cells a,b] [--waves 2] [--timeout 300]

Flags come from Megatron-LM's RL example scripts at core_r0.19.0
(``Megatron-LM/examples/rl/model_configs``: distributed optimizer with overlapped grad
reduce and param gather in the nemotron configs, ``--sequence-parallel`` with
TP) plus the KV-cache modes and CUDA graphs. One H200 runs every rank (NCCL >=
2.30 preloaded, several ranks per GPU): behaviour is real, times are not
per-GPU times. Runs of a wave run concurrently (each its own ports), so
timings here are not compared; the figures that are (step time, tokens/s)
come from experiments/rollout_gain.py, run alone and in pairs. Small NCCL
buffers (NCCL_BUFFSIZE=1 MiB, 4 channels) keep the concurrent runs inside one
GPU; the suspends, guard and ordering are the same.

Writes OUT/megatron_configs.json: per cell the verdict, the runs' outcomes,
what was suspended and kept, guard resumes, losses, and each exact command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from experiments import gpu_runs as runs  # noqa: E402

DO = ["--use-distributed-optimizer"]
OGR = ["--overlap-grad-reduce"]
OPG = ["--overlap-param-gather"]
ITERS = ["--train-iters", "4"]

#: name -> (ranks, flags for both runs, flags for the amem run only, what it shows)
CELLS = {
    "do": (2, DO, [], "distributed optimizer"),
    "do_ogr": (2, DO + OGR, [], "+ overlapped grad reduce"),
    "do_ogr_opg": (2, DO + OGR + OPG, [], "+ overlapped param gather (the crash of issue #22)"),
    "do_ogr_opg_persist": (2, DO + OGR + OPG + ["--rl-kv-cache-management-mode", "persist"], [],
                           "KV cache kept across rollouts (Megatron-LM's default mode)"),
    "do_ogr_opg_offload": (2, DO + OGR + OPG + ["--rl-kv-cache-management-mode", "offload",
                                                "--cuda-graph-impl", "local",
                                                "--rl-persist-cuda-graphs"], [],
                           "KV cache offloaded to CPU (needs torch_memory_saver)"),
    "do_ogr_opg_cudagraphs": (2, DO + OGR + OPG + ["--cuda-graph-impl", "local"], [],
                              "inference CUDA graphs, recaptured each rollout"),
    "do_ogr_opg_grow": (2, DO + OGR + OPG, ["--rl-amem-grow-kv-cache"],
                        "the KV cache grows into the freed memory"),
    "instances2": (4, DO + OGR + OPG + ["--num-distributed-optimizer-instances", "2"], [],
                   "two distributed-optimizer instances (intra/inter groups)"),
    "tp2_sp": (4, DO + OGR + OPG + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               [], "TP 2 with sequence parallel (tp kept, dp groups suspended)"),
}
SMALL_BUFFERS = {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_MAX_NCHANNELS": "4"}


def cell_runs(name: str, out: str, port: int, timeout_s: float) -> list:
    ranks, flags, amem_only, _ = CELLS[name]
    started = []
    for side in ("baseline", "amem"):
        prefix = os.path.join(out, name, side)
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        argv = runs.command(ranks, port, prefix, f"/tmp/amem-matrix/{name}-{side}",
                            side == "amem", flags + ITERS + (amem_only if side == "amem" else []))
        env = runs.environment({**SMALL_BUFFERS, "AMEM_TEXT_GEN_PORT": str(port + 1)})
        started.append(runs.Run(f"{name}/{side}", argv, prefix + ".log", timeout_s, env))
        port += 2
    return started


def summarise(name: str, outcomes: dict, out: str) -> dict:
    ranks = CELLS[name][0]
    cell = {"flags": CELLS[name][1], "amem_only_flags": CELLS[name][2], "what": CELLS[name][3],
            "ranks": ranks, "runs": {}}
    for side, outcome in outcomes.items():
        records = runs.load_records(os.path.join(out, name, side))
        complete = outcome["rc"] == 0 and len(records) == ranks and all(
            not r.get("errors") for r in records.values())
        row = dict(outcome, complete=complete, ranks_written=len(records))
        last = records.get(max(records)) if records else None
        row["losses"] = [(it["iteration"], it["loss"]) for it in last["iterations"]] if last else []
        row["iterations"] = len(row["losses"])
        first = records.get(0) or {}
        amem = first.get("amem") or {}
        if amem.get("installed"):
            begins = [t for t in amem.get("transitions", []) if t["kind"] == "begin"]
            row["suspended_per_rollout"] = [t["suspended"] for t in begins]
            row["kept_first_rollout"] = begins[0]["kept"] if begins else {}
            row["guard_resumes"] = sum(
                (r.get("amem") or {}).get("metrics", {}).get("amem/total/auto_resumes", 0)
                for r in records.values())
            row["guard_wait_s"] = max(
                ((r.get("amem") or {}).get("metrics", {}).get("amem/total/guard_wait_seconds", 0)
                 for r in records.values()), default=0)
            row["kv_cache"] = amem.get("kv_cache")
            row["rollout_groups"] = amem.get("rollout_groups")
        cell["runs"][side] = row
    base, amem = cell["runs"].get("baseline", {}), cell["runs"].get("amem", {})
    if not base.get("complete"):
        cell["verdict"] = ("baseline failed or hung: the configuration does not run here "
                           "without the package either")
    elif not amem.get("complete"):
        cell["verdict"] = "FAIL: the baseline runs, the run with the package does not"
    elif amem.get("guard_resumes"):
        cell["verdict"] = (f"pass with {amem['guard_resumes']} guard resume(s): a collective met "
                           "a suspended group and waited for its resume (no crash)")
    else:
        cell["verdict"] = "pass: no crash, no hang, no collective met a suspended group"
    cell["ok"] = not cell["verdict"].startswith("FAIL")
    return cell


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--cells", default=",".join(CELLS), help="comma list of cells")
    parser.add_argument("--waves", type=int, default=2, help="cells are run in this many waves")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args(argv)
    names = [n for n in args.cells.split(",") if n]
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        parser.error(f"unknown cell(s) {unknown}: choose from {', '.join(CELLS)}")
    os.makedirs(args.out, exist_ok=True)
    runs.install_bundle()
    waves = [names[i::args.waves] for i in range(args.waves)]
    result = {"command": " ".join([sys.executable] + sys.argv), "cells": {},
              "nccl_env": SMALL_BUFFERS, "date": time.strftime("%Y-%m-%d"),
              "source": "Megatron-LM core_r0.19.0 examples/rl/model_configs (flags)"}
    port = 29600
    for wave in waves:
        started = {}
        for name in wave:
            started[name] = cell_runs(name, args.out, port, args.timeout)
            port += 10
        for name, pair in started.items():
            outcomes = {run.name.split("/")[1]: run.wait() for run in pair}
            result["cells"][name] = summarise(name, outcomes, args.out)
            print(f"{name}: {result['cells'][name]['verdict']}", flush=True)
        with open(os.path.join(args.out, "megatron_configs.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    result["ok"] = all(c["ok"] for c in result["cells"].values())
    with open(os.path.join(args.out, "megatron_configs.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
