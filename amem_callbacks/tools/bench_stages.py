"""What ``amem-callbacks bench`` runs (quick or --full) and its progress lines with an ETA.

The full sweep takes minutes on one GPU with 2 ranks: with NCCL's default
buffers a 2-rank communicator on one GPU holds about a GB and one suspend of it
takes seconds, and the full run does hundreds of them. The quick
run keeps one figure of each kind on 2 groups and small NCCL buffers, where a
transition takes ~0.4 s: about a minute on one GPU and on 2 CPU ranks.
"""

from __future__ import annotations

import os
import sys
import time

from .progress import REPEATS

# The bench's groups, Megatron-like roles, as many as --groups asks (cli caps it here).
ROLES = ("world", "dp", "dp_cp", "cp", "expert_dp", "intra_dp_cp", "embd", "pos_embd",
         "inter_dist_opt", "tp_dp", "ep", "pp")
# bandwidth_*: P4's all-reduce, 7 timed windows of that many calls (not options).
# backup_cycles: P6 in --full only, since its figure is one at NCCL's default buffers.
QUICK = {"groups": 2, "steps": 2, "rollout_s": 1.0, "train_s": 0.2, "grad_mib": 16,
         "modes": ("none", "naive", "overlap"), "pairs": 3, "sweep": [], "guard_calls": 1200,
         "bandwidth_mib": 16, "bandwidth_iters": 5,
         "backup_cycles": 0}
FULL = {"groups": 8, "steps": 4, "rollout_s": 2.0, "train_s": 0.5, "grad_mib": 64,
        "modes": ("none", "naive", "overlap", "recreate"), "pairs": 3, "sweep": [1, 2, 4, 8],
        "guard_calls": 12000, "bandwidth_mib": 256, "bandwidth_iters": 20,
        "backup_cycles": 3}
# Fewer, smaller buffers: the same suspend/resume behaviour, ~10x shorter transitions.
SMALL_BUFFERS = {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_MAX_NCHANNELS": "4"}

# Rough costs, only for the first ETA (later ones scale by what the finished
# stages really took), from one GPU with 2 ranks on it: seconds per group and
# transition; per small all-reduce; per MiB all-reduced with small buffers.
_GROUP_S = {"cpu": 0.01, "small": 0.4, "default": 4.0}
_SMALL_CALL_S = {True: 4.5e-3, False: 1e-3}
_MIB_S = 1.1e-3


def resolve(args):
    """Fill the options left unset from the quick or the --full preset."""
    preset = FULL if args.full else QUICK
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    return args


def buffer_env(full: bool, environ=os.environ) -> dict:
    """NCCL variables the quick run sets: none with --full, none the user already set."""
    if full:
        return {}
    return {k: v for k, v in SMALL_BUFFERS.items() if k not in environ}


def plan(args, on_gpu: bool, workers: int) -> list:
    """(label, estimated seconds) per stage, in the order the bench runs them."""
    kind = "cpu" if not on_gpu else (
        "small" if os.environ.get("NCCL_BUFFSIZE") == SMALL_BUFFERS["NCCL_BUFFSIZE"]
        else "default")
    batch = args.groups * _GROUP_S[kind]  # one begin or one end of every group
    step = args.rollout_s + args.train_s
    per_mode = {"none": 0.0, "naive": 2 * batch, "touch": 2 * batch, "touch-nolearn": 2 * batch,
                "overlap": 2 * batch / max(1, workers), "recreate": args.groups * 1.0}
    calls = args.guard_calls * 3.2  # both sides, warm-up, the nothing-suspended loop
    mib = args.bandwidth_mib if on_gpu else 4
    bandwidth = (5 + 7 * args.bandwidth_iters) * mib * _MIB_S
    stages = [("bandwidth before", bandwidth)]
    stages += [(f"sweep workers={w}", 4 * batch / w) for w in args.sweep]
    stages += [(f"mode {m} ({args.steps} steps)", args.steps * (step + per_mode[m]))
               for m in args.modes]
    if args.pairs:
        stages.append((f"interleaved pairs ({args.pairs})",
                       args.pairs * args.steps * (2 * step + per_mode["overlap"])
                       + args.steps * step))  # and the control
    stages += [("guard overhead (P3)", 2 * batch + calls * _SMALL_CALL_S[on_gpu]),
               ("caller-thread progress (P5)", REPEATS * (1.0 + 2 * batch / max(1, workers)))]
    if on_gpu and args.backup_cycles:  # re-pinned blocks cost NCCL's rate, kept ones ~1/5
        stages.append(("host backup cycles (P6)",
                       2 * (args.backup_cycles + 1) * 2 * batch * (1 + 0.2)))
    stages.append(("bandwidth after", bandwidth))
    return stages


class Stages:
    """One stderr line per finished stage, with the time left (rank 0 only).

    The estimate starts from :func:`plan` and is rescaled by how long the
    finished stages took against their estimates."""

    def __init__(self, stages: list, enabled: bool, out=None):
        self.stages, self.enabled, self.out = list(stages), enabled, out or sys.stderr
        self.done, self.planned_done, self.started = 0, 0.0, time.monotonic()
        self._stage_start = self.started
        if enabled:
            self._write(f"bench: {len(self.stages)} stages, about "
                        f"{_seconds(sum(s for _, s in self.stages))} (first estimate)")

    def finished(self, label: str) -> None:
        now = time.monotonic()
        took = now - self._stage_start
        self._stage_start = now
        if self.done < len(self.stages):
            self.planned_done += self.stages[self.done][1]
        self.done += 1
        if not self.enabled:
            return
        left = sum(s for _, s in self.stages[self.done:])
        scale = (now - self.started) / self.planned_done if self.planned_done > 0 else 1.0
        eta = "done" if self.done >= len(self.stages) else f"about {_seconds(left * scale)} left"
        self._write(f"bench [{self.done}/{len(self.stages)}] {label}: {took:.1f} s; {eta}")

    def _write(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()


def _seconds(s: float) -> str:
    return f"{max(1.0, s):.0f} s" if s < 120 else f"{s / 60:.1f} min"
