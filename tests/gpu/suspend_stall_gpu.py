"""Does a rank's GPU work go on while NCCL suspends its communicators?

Megatron's rollout on Qwen3's preset (results/one_h200/rollout_gain_qwen3_dp2) started
its first engine step 0.93 s after the request, while the package's overlapped begin
was suspending, and that step ended 0.06-0.11 s after the suspends did: 2.5 s instead of
0.33 s. The rollout's caller thread ran on (the package releases the GIL); its GPU work
did not. NCCL's suspend allocates the pinned host backup it copies into (cudaHostAlloc,
about 0.7 s/GiB) and copies with a synchronous cudaMemcpy (FIELD-NOTES section 9).

This measures, on real NCCL, the time a fixed amount of engine-like work takes (steps of
many small kernels and one host sync, as a decode step is) when it starts together with
a begin that suspends ``world`` and ``dp``:

- ``first``: the process's first begin, overlapped: the one cycle that still pins while
  the backup is kept (``AMEM_HOST_BACKUP_BLOCKS=registered``, the default, or
  ``allocated``, NCCL's own cudaHostAlloc: run the script once each, fresh processes);
- ``none``: no transition (the baseline, measured first and last);
- ``overlapped``: the begin runs in the background, the steps start at once;
- ``serial``: the begin first, the steps once it is over;
- ``pin_only``: a thread pins as many host bytes as the suspend will (cudaHostAlloc,
  no GIL held), the steps at once: the stall of the pinning alone;
- ``alloc_none``, ``alloc_overlapped``: steps that also allocate device memory (a
  prefill's activations do), without and beside the begin: whether a cudaMalloc waits
  for the suspends where kernels alone do not;
- ``held``: the begin holds its suspends (``begin(hold_s=...)``) until the rank's first
  step has ended, rank r lets go ``r * HELD_SKEW_S`` later (NCCL's suspend waits for
  every member: the rank that lets go first waits in the background): the first step
  as early as without a begin, as Megatron's adapter does it.

and says which order finishes the work first. Rounds interleave the modes.

Command (NCCL >= 2.30 loaded; several ranks on one GPU):
    PYTHONPATH=. NCCL_MULTI_RANK_GPU_ENABLE=1 python -m torch.distributed.run \\
        --nproc-per-node 2 tests/gpu/suspend_stall_gpu.py OUT.json [ROUNDS]

CPU check of this script (gloo, the fake NCCL; not a GPU result):
    PYTHONPATH=. AMEM_GPU_DRIVER_ON_CPU=1 python -m torch.distributed.run \\
        --nproc-per-node 2 tests/gpu/suspend_stall_gpu.py /tmp/stall.json 1
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from amem_callbacks import OffloadPolicy, host_backup, name_group
from tests.gpu.common import ON_CPU, bind_device, cpu_notes, exact_allreduce, gloo_group, \
    policy_backend, process_group_backend, provenance, set_aside_on_cpu, tensor_device

#: (transition, steps): the kernel-only steps beside no transition, an overlapped begin,
#: a serial one and the pinning alone; then steps that also allocate device memory
#: (torch's cache emptied each step, so each allocation reaches cudaMalloc), beside no
#: transition and an overlapped begin: whether an allocation waits for the suspends
MODES = ("none", "overlapped", "serial", "pin_only", "alloc_none", "alloc_overlapped", "held")
HELD_SKEW_S = 0.3
ALLOC_BYTES = 64 << 20
KERNELS_PER_STEP = 200  # Megatron's decode step launches hundreds of small kernels
# the work: as many steps as the baseline runs in this long (AMEM_GPU_QUICK: the CPU check)
BASELINE_S = 0.3 if os.environ.get("AMEM_GPU_QUICK") == "1" else 3.0


def engine_step(x: torch.Tensor) -> float:
    """Many small kernels, then a host sync (the step's sampled tokens)."""
    for _ in range(KERNELS_PER_STEP):
        x.mul_(0.999).add_(0.001)
    return float(x[0].item())


def allocating_step(x: torch.Tensor) -> float:
    """An engine step that also allocates device memory, as a prefill's activations do."""
    torch.cuda.empty_cache()
    torch.empty(ALLOC_BYTES, dtype=torch.uint8, device=x.device).fill_(1)
    return engine_step(x)


def run_steps(x: torch.Tensor, count: int, step=engine_step, after_step=None) -> list:
    """Each step's (began, ended), monotonic; ``after_step(ended)`` after each."""
    out = []
    for _ in range(count):
        began = time.monotonic()
        step(x)
        out.append((began, time.monotonic()))
        if after_step is not None:
            after_step(out[-1][1])
    return out


#: NCCL 2.30.7's suspend pins a backup for each offloaded entry of a communicator
#: (hundreds of them, src/mem_manager.cc): cudaHostAlloc(cudaHostAllocMapped), then memset
#: (ncclCudaHostCalloc, src/include/alloc.h); the pinning mode does the same in pieces
PIN_PIECE = 8 << 20
CUDA_HOST_ALLOC_MAPPED = 2


def pinner():
    """``pin(nbytes)``: pin that many host bytes as NCCL's suspend does (in pieces, each
    mapped and zeroed), then free them, the GIL released (ctypes). On CPU: a libc sleep
    of the same GIL-free kind (the figure is set aside)."""
    libc = ctypes.CDLL(None)
    if ON_CPU:
        def sleep(nbytes: int) -> float:
            libc.usleep(ctypes.c_uint(20000))
            return 0.02
        return sleep
    try:
        cudart = ctypes.CDLL(_loaded("libcudart"))
    except (RuntimeError, OSError):  # a torch linked to it statically: the mode is left out
        return None

    def pin(nbytes: int) -> float:
        """Pins, frees; the seconds it took."""
        began = time.monotonic()
        pieces = []
        try:
            for offset in range(0, nbytes, PIN_PIECE):
                size = min(PIN_PIECE, nbytes - offset)
                ptr = ctypes.c_void_p()
                if cudart.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(size),
                                        CUDA_HOST_ALLOC_MAPPED) != 0:
                    raise RuntimeError(f"cudaHostAlloc of {size} bytes failed")
                pieces.append(ptr)
                libc.memset(ptr, 0, ctypes.c_size_t(size))
        finally:
            for ptr in pieces:
                cudart.cudaFreeHost(ptr)
        return time.monotonic() - began
    return pin


def _loaded(stem: str) -> str:
    """The path of the library this process already loaded (torch's CUDA runtime)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if stem in path.rsplit("/", 1)[-1]:
                return path
    raise RuntimeError(f"{stem} is not loaded in this process")


def one_mode(mode: str, policy: OffloadPolicy, x: torch.Tensor, count: int, nbytes: int,
             pin, sync) -> dict:
    """The work of ``count`` steps starting with ``mode``'s transition; the groups are
    active again (and checked exact by the caller) when it returns."""
    dist.barrier(group=sync)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    report, pinning, pinned_s, after_step = None, None, [], None
    step = allocating_step if mode.startswith("alloc_") else engine_step
    transition = mode.removeprefix("alloc_")
    if transition in ("overlapped", "serial", "held"):
        report = policy.begin("rollout", hold_s=60.0 if transition == "held" else 0.0)
        if transition == "serial":
            policy.wait()
    elif transition == "pin_only":
        pinning = threading.Thread(target=lambda: pinned_s.append(pin(nbytes)))
        pinning.start()
    if transition == "held":  # let go after the first step, rank r r * HELD_SKEW_S later
        let_go_at = None

        def after_step(ended: float) -> None:
            nonlocal let_go_at
            if let_go_at is None:
                let_go_at = ended + dist.get_rank() * HELD_SKEW_S
            if ended >= let_go_at:
                policy.start_suspends()  # a no-op once they started
    steps = run_steps(x, count, step, after_step)
    work_s = steps[-1][1] - t0
    transition_s, held_s = None, None
    if report is not None:
        report = policy.wait() or report
        transition_s = report.wall_seconds - report.held_seconds
        held_s = report.held_seconds
    if pinning is not None:
        pinning.join()
        transition_s = pinned_s[0] if pinned_s else None
    dist.barrier(group=sync)
    if report is not None:
        policy.end("rollout")
        policy.wait()  # an overlapped end: over before the next mode's clock starts
    durations = [b - a for a, b in steps]
    suspended = list(report.suspended) if report else []
    return {"mode": mode, "work_s": work_s, "transition_s": transition_s, "held_s": held_s,
            "suspended": [g.name for g in suspended],
            "suspended_bytes": sum(g.suspendable_bytes or 0 for g in suspended),
            "first_step_ended_s": steps[0][1] - t0,
            "step_s_median": statistics.median(durations), "step_s_max": max(durations)}


def main() -> None:
    out_path = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    bind_device()
    # before the first communicator, as an adapter does: NCCL's runtime then finds the
    # host-backup hook (AMEM_HOST_BACKUP=0 measures NCCL re-pinning every suspend)
    policy = OffloadPolicy(backend=policy_backend("nccl"), overlap=True, agree_timeout_s=60)
    dist.init_process_group(process_group_backend("nccl"))
    rank = dist.get_rank()
    sync = gloo_group()
    groups = {"world": dist.group.WORLD, "dp": dist.new_group(list(range(dist.get_world_size())))}
    name_group(groups["dp"], "dp")
    for g in groups.values():
        assert exact_allreduce(g, 1.0)
    x = torch.ones(1 << 20, device=tensor_device())
    engine_step(x)
    deadline, count = time.monotonic() + BASELINE_S, 0
    while time.monotonic() < deadline:  # the work: what the baseline does in BASELINE_S
        engine_step(x)
        count += 1
    count = max(count, 1)
    counts = [0] * dist.get_world_size()
    dist.all_gather_object(counts, count, group=sync)
    count = min(counts)  # every rank the same work
    # The process's first begin, measured as "overlapped" is: the only one that pins
    # anew while the backup is kept (AMEM_HOST_BACKUP_BLOCKS says how it pins)
    first = dict(one_mode("overlapped", policy, x, count, 0, None, sync), mode="first", round=-1)
    first_pinning = {k: v for k, v in host_backup.stats().items()
                     if k in ("pinned_new", "pinned_new_bytes", "registered_new", "pin_ns",
                              "register_failed", "registered_on")}
    # what the suspend pins: the suspendable bytes of the groups it suspends
    nbytes = first["suspended_bytes"] or (1 << 30)
    pin = pinner()
    modes = MODES if pin is not None else tuple(m for m in MODES if m != "pin_only")
    rows = [first]
    for r in range(rounds):
        order = modes if r % 2 == 0 else modes[:1] + modes[1:][::-1]
        for mode in order:
            rows.append(dict(one_mode(mode, policy, x, count, nbytes, pin, sync), round=r))
    rows.append(dict(one_mode("none", policy, x, count, nbytes, pin, sync), round=rounds))
    exact = all(exact_allreduce(g, 3.0) for g in groups.values())

    def median(mode, key):
        values = [row[key] for row in rows if row["mode"] == mode and row[key] is not None]
        return statistics.median(values) if values else None

    summary = {mode: {key: median(mode, key) for key in
                      ("work_s", "transition_s", "first_step_ended_s", "step_s_median")}
               for mode in ("first",) + modes}
    base = summary["none"]["work_s"]
    for mode in ("first",) + modes:  # each kind of step against its own baseline
        own = summary["alloc_none" if mode.startswith("alloc_") else "none"]["work_s"]
        summary[mode]["work_ratio"] = summary[mode]["work_s"] / own if own else None
    checks = {"exact_after_every_cycle": exact,
              "every_mode_measured": all(summary[m]["work_s"] for m in modes)}
    verdict = {
        "overlap_finishes_first": summary["overlapped"]["work_s"] < summary["serial"]["work_s"],
        # the GPU work stood still for most of the suspends: the overlap bought little
        "work_stalls_during_suspend": summary["overlapped"]["work_s"] >= base + 0.5 * (
            summary["serial"]["transition_s"] or 0),
        # an allocation waited for them beyond what the kernels did
        "allocation_waits_for_suspend": summary["alloc_overlapped"]["work_ratio"] >= 1.2 * (
            summary["overlapped"]["work_ratio"] or 0),
    }
    verdict["held_first_step_on_time"] = summary["held"]["first_step_ended_s"] <= (
        summary["none"]["first_step_ended_s"] + 0.05)
    if "pin_only" in summary:
        verdict["pinning_alone_stalls"] = summary["pin_only"]["work_s"] >= base + 0.5 * (
            summary["pin_only"]["transition_s"] or 0)
    set_aside_on_cpu(verdict, *list(verdict))
    result = {"rank": rank, "torch": torch.__version__, "steps": count,
              "host_backup": {"kept": host_backup.active(), "why_not": host_backup.why_inactive(),
                              "stats": host_backup.stats()},
              "first_cycle_pinning": first_pinning, "blocks": os.environ.get(
                  host_backup.ENV_BLOCKS, host_backup.BLOCK_KINDS[0]),
              "kernels_per_step": KERNELS_PER_STEP, "pinned_bytes": nbytes,
              "suspended": first["suspended"], "summary": summary,
              "verdict": verdict, "checks": checks, "rows": rows, **cpu_notes(),
              **provenance("tests/gpu/suspend_stall_gpu.py")}
    result["ok"] = all(checks.values())
    with open(out_path.replace(".json", f".rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    dist.barrier(group=sync)
    dist.destroy_process_group()
    print(f"rank {rank}: {'OK' if result['ok'] else 'FAILED'} "
          f"{json.dumps({m: round(summary[m]['work_ratio'] or 0, 3) for m in ('first',) + modes})} "
          f"{json.dumps(verdict)}", flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
