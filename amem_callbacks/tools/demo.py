"""``amem-callbacks demo``: a small RL-shaped loop (train, then rollout) on the
local GPUs with real NCCL suspend (several ranks per GPU where NCCL allows it,
so one GPU is enough), or on 2 CPU processes as a dry run.

Each step trains a tiny model with a gradient all-reduce on the data-parallel
group, then enters rollout: the policy suspends the groups rollout does not use
(keeping "tp"), the rollout computes, and the policy resumes them.
"""

from __future__ import annotations

import os
import sys
import tempfile

from .launch import backend_refusal, plan_ranks, quiet_missing_numpy


def main(steps: int = 5, rollout_s: float = 0.5, backend: str = None,
         ranks: int = None, out: str = None) -> int:
    """``out``: the folder for demo.json (the CLI checked it is writable)."""
    quiet_missing_numpy()
    # torch, after the line above, and not at the top: the CLI imports this module
    from . import demo_rank

    layout = plan_ranks(ranks)
    if layout.refused:
        print(f"amem-callbacks demo: {layout.refused}")
        return 1
    refused = backend_refusal(backend, layout.on_gpu)
    if refused:  # before any rank starts: a demo of a backend that cannot run shows nothing
        print(f"amem-callbacks demo: {refused}", file=sys.stderr)
        return 1
    use_cuda = layout.on_gpu
    world = layout.ranks
    os.environ.update(layout.env)  # inherited by the rank processes
    backend = backend or ("auto" if use_cuda else "noop")
    where = layout.describe() if use_cuda else (
        f"{world} CPU processes, gloo (dry run: no GPU here)")
    print(f"amem-callbacks demo: {where}, backend {backend!r}, {steps} steps")
    out = out or tempfile.mkdtemp(prefix="amem-demo-")
    demo_rank.spawn(world, steps, rollout_s, backend, use_cuda, out)
    return 0
