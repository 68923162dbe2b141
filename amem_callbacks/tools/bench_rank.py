"""The rank side of ``amem-callbacks bench``: the synthetic RL loop on one rank and
what it measures (the modes and figures are described in bench.py).

torch is imported at the top: this module is imported only in the rank
processes and by ``bench.main`` once ``quiet_missing_numpy()`` ran; the CLI
parses with bench.py's names alone, without torch.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import guard, host_backup
from ..backends.torch_comms import torch_backend_of
from ..groups import name_group
from ..options import DEFAULT_WORKERS
from ..policy import OffloadPolicy
from .bench_backup import backup_cycles
from .bench_stages import ROLES, Stages, plan
from .launch import free_port, gather_ints, local_device
from .pairs import interleaved
from . import provenance
from .progress import transition_progress, transition_suspects


class MemorySampler:
    """Device free memory every few ms, labelled with the phase the loop is in."""

    def __init__(self, device, interval_s: float = 0.01):
        self.device, self.interval_s = device, interval_s
        self.phase = "setup"
        self.samples = []
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self):
        if self.device is not None:
            self._thread.start()
        return self

    def _loop(self) -> None:
        torch.cuda.set_device(self.device)
        while not self._stop.is_set():
            free = torch.cuda.mem_get_info(self.device)[0]
            self.samples.append((time.monotonic() - self._start, free, self.phase))
            time.sleep(self.interval_s)

    def stop(self) -> list:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.samples


class Loop:
    """The synthetic RL loop on one rank."""

    def __init__(self, args, rank: int, world: int, use_cuda: bool):
        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world, self.use_cuda = rank, world, use_cuda
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda \
            else torch.device("cpu")
        self.sync = dist.new_group(backend="gloo")  # barriers while NCCL groups sleep
        self.names = list(ROLES[:args.groups])
        self.groups = {}
        self._make_groups()
        self.tp = dist.new_group(list(range(world)))
        name_group(self.tp, "tp")
        self.grad = torch.ones(args.grad_mib * 2**18, device=self.device)
        self.small = torch.ones(1, device=self.device)
        self.a = torch.randn(2048 if use_cuda else 128, 2048 if use_cuda else 128,
                             device=self.device)
        for group in self.all_groups():
            dist.all_reduce(self.small, group=group)
        self.synchronize()

    def _make_groups(self) -> None:
        for name in self.names:
            group = self.dist.group.WORLD if name == "world" else \
                self.dist.new_group(list(range(self.world)))
            if name != "world":
                name_group(group, name)
            self.groups[name] = group

    def all_groups(self) -> list:
        return list(self.groups.values()) + [self.tp]

    def synchronize(self) -> None:
        if self.use_cuda:
            self.torch.cuda.synchronize()

    def compute(self, seconds: float) -> None:
        """Busy the device for ``seconds`` (checked every few kernels)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for _ in range(8):
                self.a = self.torch.tanh(self.a @ self.a / 64)
            self.synchronize()

    def train(self) -> float:
        """Returns the seconds spent in the collectives after the compute: where
        a resume that has not finished yet shows up (the guard waits there)."""
        self.compute(self.args.train_s)
        start = time.perf_counter()
        self.dist.all_reduce(self.grad, group=self.groups.get("dp", self.dist.group.WORLD))
        for group in self.all_groups():
            self.dist.all_reduce(self.small, group=group)
        self.synchronize()
        return time.perf_counter() - start

    def rollout(self, touch: bool = False) -> None:
        self.compute(self.args.rollout_s)
        self.dist.all_reduce(self.small, group=self.tp)  # the kept group keeps working
        if touch:  # e.g. a logging all-reduce nobody listed in keep=
            self.dist.all_reduce(self.small, group=self.groups.get("dp", self.dist.group.WORLD))

    def destroy_groups(self) -> None:
        for name in self.names:
            if name != "world":
                self.dist.destroy_process_group(self.groups[name])

    def recreate_groups(self) -> None:
        for name in [n for n in self.names if n != "world"]:  # torch cannot re-create WORLD
            self.groups[name] = self.dist.new_group(list(range(self.world)))
            name_group(self.groups[name], name)
            self.dist.all_reduce(self.small, group=self.groups[name])  # creates the comm

    def bus_bandwidth(self, windows: int = 7) -> float:
        """All-reduce bus bandwidth (GB/s) on dp, NCCL's definition; the median
        of several timed windows, so one slow window does not decide P4."""
        torch = self.torch
        group = self.groups.get("dp", self.dist.group.WORLD)
        x = torch.ones((self.args.bandwidth_mib if self.use_cuda else 4) * 2**18,
                       device=self.device)
        for _ in range(5):
            self.dist.all_reduce(x, group=group)
        per_call = []
        for _ in range(windows):
            self.synchronize()
            start = time.perf_counter()
            for _ in range(self.args.bandwidth_iters):
                self.dist.all_reduce(x, group=group)
            self.synchronize()
            per_call.append((time.perf_counter() - start) / self.args.bandwidth_iters)
        seconds = statistics.median(per_call)
        return x.numel() * x.element_size() / seconds * 2 * (self.world - 1) / self.world / 1e9

    def small_loop(self, n: int) -> float:
        self.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            self.dist.all_reduce(self.small, group=self.tp)
        self.synchronize()
        return time.perf_counter() - start


def _gpu_free(loop: Loop):
    """The GPU's free bytes once every rank got here (all ranks' memory when shared)."""
    loop.synchronize()
    loop.dist.barrier(group=loop.sync)
    return loop.torch.cuda.mem_get_info()[0] if loop.use_cuda else None


def _run_mode(loop: Loop, mode: str, policy, sampler, reports: dict) -> tuple:
    """Step times, and per step where the time went on the caller's thread:
    begin call, rollout, end call, training collectives (compute is fixed)."""
    steps, parts = [], []
    shared = loop.shared_gpu and mode in ("naive", "touch")
    for step in range(loop.args.steps):
        loop.dist.barrier(group=loop.sync)
        loop.synchronize()
        free_before = _gpu_free(loop) if shared else None
        start = time.perf_counter()
        sampler.phase = f"{mode}:rollout"
        if mode == "recreate":
            loop.destroy_groups()
        elif policy is not None:
            reports.setdefault("begin", []).append(policy.begin("rollout"))
        begun = time.perf_counter()
        if shared:  # outside the timed step: the barrier is only for the reading
            reports.setdefault("gpu_freed", []).append(_gpu_free(loop) - free_before)
            begun_at = time.perf_counter()
            start += begun_at - begun
            begun = begun_at
        loop.rollout(touch=mode.startswith("touch"))
        rolled = time.perf_counter()
        sampler.phase = f"{mode}:train"
        if mode == "recreate":
            loop.recreate_groups()
        elif policy is not None:
            reports.setdefault("end", []).append(policy.end("rollout"))
        ended = time.perf_counter()
        collectives = loop.train()
        steps.append(time.perf_counter() - start)
        parts.append({"begin_call": begun - start, "rollout": rolled - begun,
                      "end_call": ended - rolled, "train_collectives": collectives})
    if policy is not None:
        policy.wait()
    sampler.phase = "idle"
    return steps, parts


def _interleaved_pairs(loop: Loop, backend: str, workers: int, sampler, pairs: int) -> dict:
    """Without (mode none) and with the package (overlap, its default way), run in
    pairs that alternate which side goes first: a GPU that drifts would bias
    whichever side always ran first. Every rank runs the same order."""
    policy = OffloadPolicy(backend=backend, keep=["tp"], overlap=True, workers=workers,
                           groups=loop.all_groups())

    def side(mode: str, side_policy):
        def run(_index: int) -> dict:
            steps, parts = _run_mode(loop, mode, side_policy, sampler, {})
            return {"step_s": statistics.mean(steps), "steps_s": steps,
                    "caller_wait_s": statistics.mean(p["begin_call"] + p["end_call"]
                                                     for p in parts)}
        return run

    # control: the baseline once more after the pairs; how far it drifts from the
    # pairs' baselines says how much of a ratio is the machine, not the package
    return interleaved({"none": side("none", None), "overlap": side("overlap", policy)},
                       pairs=pairs, control=("none", side("none", None))).as_dict()


def _sweep(loop: Loop, backend: str, stages) -> dict:
    """Transition time of a whole batch with 1..8 worker threads (no rollout)."""
    out = {}
    for workers in loop.args.sweep:
        policy = OffloadPolicy(backend=backend, keep=["tp"], workers=workers,
                               groups=loop.all_groups())
        begins, ends = [], []
        for _ in range(2):
            loop.dist.barrier(group=loop.sync)
            begins.append(policy.begin("rollout").wall_seconds)
            loop.dist.barrier(group=loop.sync)
            ends.append(policy.end("rollout").wall_seconds)
        out[str(workers)] = {"begin_s": min(begins), "end_s": min(ends)}
        stages.finished(f"sweep workers={workers}")
    return out


def _guard_overhead(loop: Loop, backend: str, n: int, pairs: int = 24) -> dict:
    """P3: the kept group's small-collective loop while the other groups are
    suspended, with the guard in place (every call looked up) against the very
    same state with torch's own functions put back. Lifting the guard is safe
    here: the loop only uses the kept group.

    The loop is CPU-bound and its per-call time drifts by several per cent
    within seconds, more than the guard costs; so the two sides alternate in
    short blocks (``n / pairs`` calls), which flips first in every other pair,
    and P3 is the median of the per-pair ratios. Both ranks run the same
    sequence, so their collectives stay matched. The same loop with nothing
    suspended is reported too: what suspended communicators cost NCCL itself."""
    block = max(1, n // pairs)
    policy = OffloadPolicy(backend=backend, keep=["tp"], groups=loop.all_groups())
    loop.small_loop(block * 4)  # warm-up
    loop.dist.barrier(group=loop.sync)
    policy.begin("rollout")
    ratios, with_guard, without = [], [], []
    for i in range(pairs):
        timed = {}
        for guarded in ((True, False) if i % 2 == 0 else (False, True)):
            if not guarded:
                guard.uninstall()
            try:
                timed[guarded] = loop.small_loop(block)
            finally:
                if not guarded:
                    guard.install()
        ratios.append(timed[True] / timed[False])
        with_guard.append(timed[True])
        without.append(timed[False])
    loop.dist.barrier(group=loop.sync)
    policy.end("rollout")
    nothing_suspended = [loop.small_loop(block) for _ in range(pairs)]
    return {"ratio_median": statistics.median(ratios), "with_s": statistics.median(with_guard),
            "without_s": statistics.median(without),
            "nothing_suspended_s": statistics.median(nothing_suspended),
            "calls_per_block": block, "pairs": pairs}


def _caller_progress(loop: Loop, backend: str, workers: int) -> dict:
    """P5: how fast this thread runs Python while an overlapped transition is in
    flight, against its rate just before (see tools/progress.py): the median of
    three cycles."""
    policy = OffloadPolicy(backend=backend, keep=["tp"], overlap=True, workers=workers,
                           groups=loop.all_groups())
    barrier = lambda: loop.dist.barrier(group=loop.sync)  # noqa: E731
    progress = transition_progress(policy, barrier)
    # where a figure falls with no GIL-holding path, the C calls that may hold it
    progress["suspects"] = transition_suspects(policy, barrier)
    return progress


def _learned(metrics: dict, phase: str) -> dict:
    """``{phase: {group: guard resumes}}`` from the ``amem/learned/<phase>/<group>``
    figures ({} when nothing was learned in that phase)."""
    prefix = f"amem/learned/{phase}/"
    found = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}
    return {phase: found} if found else {}


def run_rank(args, rank: int, world: int, use_cuda: bool) -> dict:
    host_backup.install()  # before the first communicator, as the adapters do
    if use_cuda:
        torch.cuda.set_device(local_device(int(os.environ.get("LOCAL_RANK", rank))))
    torch_backend = (args.torch_backend or "nccl") if use_cuda else "gloo"
    dist.init_process_group(torch_backend, rank=rank, world_size=world)
    loop = Loop(args, rank, world, use_cuda)
    loop.shared_gpu = use_cuda and world > torch.cuda.device_count()
    backend = args.backend or ("nccl" if use_cuda else "noop")
    sampler = MemorySampler(torch.cuda.current_device() if use_cuda else None).start()
    stages = Stages(plan(args, use_cuda, args.workers or _best_workers(None)),
                    enabled=rank == 0)
    result = {"bandwidth_before_GBps": loop.bus_bandwidth()}
    stages.finished("bandwidth before")
    if args.sweep:
        result["sweep"] = _sweep(loop, backend, stages)
    workers = args.workers or _best_workers(result.get("sweep"))
    result["overlap_workers"] = workers
    modes = {}
    for mode in args.modes:
        policy = None
        if mode != "none" and mode != "recreate":
            policy = OffloadPolicy(backend=backend, keep=["tp"], overlap=mode == "overlap",
                                   workers=workers if mode == "overlap" else 1,
                                   learn_keep=mode != "touch-nolearn", groups=loop.all_groups())
        reports = {}
        steps, parts = _run_mode(loop, mode, policy, sampler, reports)
        gpu_freed = reports.pop("gpu_freed", None)
        modes[mode] = {"step_s": steps, "parts_s": parts, "reports": {
            kind: [_report_row(r) for r in rs] for kind, rs in reports.items()}}
        if gpu_freed is not None:  # every rank's NCCL bytes, for P1 on a shared GPU
            nccl = gather_ints([r.nccl_bytes for r in reports["begin"]], loop.sync)
            modes[mode]["gpu_freed"] = gpu_freed
            modes[mode]["nccl_bytes_all_ranks"] = [sum(step) for step in zip(*nccl)]
        if policy is not None:
            totals = policy.metrics(last=False)
            modes[mode]["auto_resumes"] = totals.get("amem/total/auto_resumes")
            modes[mode]["learned"] = _learned(totals, "rollout")
        stages.finished(f"mode {mode} ({args.steps} steps)")

    result["modes"] = modes
    if args.pairs:
        result["pairs"] = _interleaved_pairs(loop, backend, workers, sampler, args.pairs)
        stages.finished(f"interleaved pairs ({args.pairs})")
    result["guard"] = _guard_overhead(loop, backend, args.guard_calls)
    stages.finished("guard overhead (P3)")
    result["caller_progress"] = _caller_progress(loop, backend, workers)
    stages.finished("caller-thread progress (P5)")
    if use_cuda and args.backup_cycles:
        result["host_backup"] = backup_cycles(loop, backend, workers, args.backup_cycles)
        stages.finished("host backup cycles (P6)")
    result["ranks_per_gpu"] = (-(-world // torch.cuda.device_count())) if use_cuda else 0
    result["bandwidth_after_GBps"] = loop.bus_bandwidth()
    stages.finished("bandwidth after")
    dist.barrier(group=loop.sync)
    result["timeline"] = sampler.stop()
    result["backend"] = backend
    result["torch_backend"] = torch_backend
    result["torch_backend_class"] = _class_of(dist.group.WORLD) if use_cuda else None
    # from a rank: the process that loaded the NCCL the figures are of
    result["commit"], result["machine"] = provenance.commit(), provenance.machine(gpu=use_cuda)
    dist.barrier(group=loop.sync)
    dist.destroy_process_group()
    return result


def _class_of(group):
    """The class torch made for ``group`` on this GPU (ProcessGroupNCCL, ProcessGroupNCCL2,
    ...): on torch 2.15 one backend name may mean either, so the figures say which ran."""
    found, _why = torch_backend_of(group, torch.cuda.current_device())
    return type(found).__name__ if found is not None else None


def _best_workers(sweep) -> int:
    if not sweep:
        return DEFAULT_WORKERS
    return int(min(sweep, key=lambda w: sweep[w]["begin_s"] + sweep[w]["end_s"]))


def _report_row(report) -> dict:
    return {"wall_s": report.wall_seconds, "nccl_bytes": report.nccl_bytes,
            "device_freed": report.device_freed_bytes, "agree_s": report.agree_seconds,
            "groups": {g.name: [g.action, round(g.seconds, 4)] for g in report.groups},
            "stays": {g.name: [g.stays_bytes, g.stays_why] for g in report.groups
                      if g.stays_bytes},
            "transport": {g.name: g.transport for g in report.groups if g.transport},
            "paths": sorted({g.path for g in report.groups if g.path}),
            "skipped": report.skipped}


def _worker(rank: int, world: int, port: int, args, use_cuda: bool, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    result = run_rank(args, rank, world, use_cuda)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def spawn(world: int, args, use_cuda: bool, out_path: str) -> None:
    """``world`` rank processes (spawned, never forked: CUDA does not survive a
    fork); rank 0 writes its figures to ``out_path``."""
    mp.start_processes(_worker, args=(world, free_port(), args, use_cuda, out_path),
                       nprocs=world, start_method="spawn")
