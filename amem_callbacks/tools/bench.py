"""``amem-callbacks bench``: what offloading costs a synthetic RL loop, in one run.

Quick by default, ``--full`` for the whole sweep (the presets and the progress
lines are in bench_stages.py).

Each step is a rollout (compute only, for ``rollout_s``; the kept "tp" group
still runs a collective) followed by a training phase (compute for ``train_s``,
then a gradient all-reduce on "dp" and a small all-reduce on every other
group). Modes, in one run on the same groups:

    none      no offload (the baseline)
    naive     suspend and resume on the critical path, one group after another
    overlap   this project: begin/end return at once; the transitions run on a
              worker while rollout computes, and training collectives wait for
              their own group only (the guard)
    recreate  destroy the groups for rollout and create them again (slime's way)
    touch     naive, and rollout also calls a collective on one suspended group
              ("dp"): the guard resumes it; with learn_keep the policy keeps it
              active from the next rollout on (touch-nolearn: learn_keep off)

Figures, all ratios of this run's own measurements:
    P1  device bytes freed / NCCL's suspendable bytes
    P2  extra step time with overlap / with naive
    P2b begin -> memory actually free, overlap / naive
    P3  small-collective loop on the kept group while others are suspended:
        guard in place / torch's own functions, same state (the loop with
        nothing suspended is reported beside it as P3_state)
    P4  all-reduce bus bandwidth after the cycles / before
    recreate_over_overlap  extra step time of recreate / of overlap
    P5  caller-thread progress during an overlapped begin (and end): a pure
        Python loop's rate while the transition runs / its rate before; a
        transition that holds the GIL drives it towards 0
    learn_over_nolearn  steady step time of touch / of touch-nolearn

With more ranks than GPUs (several per GPU), cudaMemGetInfo sees every
sharing rank: P1 then divides the GPU's freed bytes, read between barriers,
by the NCCL bytes of all ranks on it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

from .bench_report import summarise, write_outputs
from .bench_stages import ROLES, buffer_env  # noqa: F401 (ROLES: the CLI reads it here)
from .launch import backend_refusal, plan_ranks, quiet_missing_numpy, torch_backend_refusal

MODES = ("none", "naive", "overlap", "recreate", "touch", "touch-nolearn")
DEFAULT_MODES = ("none", "naive", "overlap", "recreate")


def main(args) -> int:
    """``args`` as the CLI leaves them: presets resolved, ``args.out`` checked writable."""
    quiet_missing_numpy()
    # torch, after the line above, and not at the top: the CLI imports this module to parse
    from . import bench_rank

    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    layout = plan_ranks(int(os.environ["WORLD_SIZE"]) if torchrun else args.ranks)
    if layout.refused:
        print(f"amem-callbacks bench: {layout.refused}")
        return 1
    use_cuda = layout.on_gpu
    # nccl is the GPU default: a bench measures one backend, so it must work here
    refused = (backend_refusal(args.backend or ("nccl" if use_cuda else "noop"), use_cuda)
               or torch_backend_refusal(args.torch_backend, use_cuda))
    if refused:
        print(f"amem-callbacks bench: {refused}", file=sys.stderr)
        return 1
    if not use_cuda:
        print(f"amem-callbacks bench: no GPU here, so this is a dry run on {layout.ranks} CPU "
              "processes with the noop backend; the figures are not GPU figures and no goal "
              "is graded.")
        args.sweep = []
    else:
        print(f"amem-callbacks bench: {layout.describe()}")
    print(f"  {'full' if args.full else 'quick (--full for the whole sweep)'}: modes "
          f"{','.join(args.modes)}, {args.groups} groups, {args.steps} steps per mode, "
          f"worker sweep {','.join(map(str, args.sweep)) or 'none'}")
    buffers = buffer_env(args.full) if use_cuda else {}
    if buffers:
        print("  small NCCL buffers, so transitions take ~0.4 s: " + " ".join(
            f"{k}={v}" for k, v in buffers.items()) + " (set them yourself, or --full, for "
            "NCCL's defaults)")
    print(f"  results go to {os.path.join(args.out, 'bench.json')}", flush=True)
    os.environ.update(layout.env, **buffers)  # inherited by the rank processes
    if torchrun:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        raw = bench_rank.run_rank(args, rank, world, use_cuda)
        if rank != 0:
            return 0
    else:
        world = layout.ranks
        scratch = tempfile.mkdtemp(prefix="amem-bench-raw-")  # rank 0 hands its figures over
        try:
            raw_path = os.path.join(scratch, "rank0.json")
            bench_rank.spawn(world, args, use_cuda, raw_path)
            with open(raw_path) as f:
                raw = json.load(f)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = summarise(raw, args, world, dry_run=not use_cuda)
    write_outputs(summary, raw, args.out)
    return 0
