"""Reliability on real NCCL, 2 ranks (3 for the faults inside the NCCL call):
faults, bad set-ups and long runs.

Command (2 GPUs; NCCL >= 2.29.7 preloaded, e.g. the output of ../shared/tools/device-nccl;
one GPU with NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1 is set here); CASE names pick a subset:
    LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONPATH=$PWD python3 tests/gpu/reliability_gpu.py \\
        OUT.json [CASE ...]

This file is both the driver and the rank program. The driver starts the rank
processes of each case (its own launcher, so that each case can change the
environment NCCL sees, e.g. drop the preload or set NCCL_CUMEM_ENABLE=0),
bounds every case by a wall-clock limit (a hang is a failure, not a stuck job),
and writes one JSON table: case, what must hold, pass/fail, seconds, details.

Ranks synchronise over a gloo group while NCCL groups are suspended: a
collective on a suspended NCCL communicator is an illegal memory access.

``AMEM_GPU_DRIVER_ON_CPU=1`` (or the older ``AMEM_RELIABILITY_CPU=1``) runs the
cases that do not need a GPU on gloo with the fake NCCL of tests/fake_nccl, the
CPU mode of tests/gpu/common.py (a check of this script, not a GPU result):
    AMEM_GPU_DRIVER_ON_CPU=1 AMEM_GPU_QUICK=1 python3 tests/gpu/reliability_gpu.py \\
        /tmp/reliability.json [CASE ...]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # tests.gpu.common from any working directory
    sys.path.insert(0, ROOT)

from tests.gpu import common  # noqa: E402

CPU = common.ON_CPU
# AMEM_GPU_QUICK=1 (the one-GPU runner): fewer seeds and cycles. Two ranks on one
# GPU make each transition several times slower (shared device, pinned copies).
QUICK = os.environ.get("AMEM_GPU_QUICK") == "1"
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Case:
    fn: object
    must_hold: str
    limit_s: float
    env: dict
    ranks: int = 2
    #: driver-side fault, run on a thread while the ranks run:
    #: ``during(procs, out_dir, facts)`` fills ``facts``; ``facts["ok"] is False`` fails the case
    during: object = None
    #: ranks that die on purpose: not judged, and nobody waits for them at the end
    victims: tuple = ()
    #: survivors try dist.destroy_process_group() (bounded) before os._exit, and say how it went
    exit_probe: bool = False


CASES = {}  # name -> Case


def case(must_hold: str, limit_s: float, env: dict = None, gpu_only: bool = False, **more):
    def register(fn):
        if not (gpu_only and CPU):
            CASES[fn.__name__] = Case(fn, must_hold, limit_s, env or {}, **more)
        return fn
    return register


# --- what every rank process has -----------------------------------------
class Rank:
    def __init__(self, c10d_timeout_s: float):
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        if CPU:
            self.device = "cpu"
            dist.init_process_group("gloo", timeout=timedelta(seconds=c10d_timeout_s))
        else:
            from tests.gpu.common import bind_device

            bind_device()
            self.device = f"cuda:{torch.cuda.current_device()}"
            dist.init_process_group("nccl", timeout=timedelta(seconds=c10d_timeout_s))
        self.timeout = timedelta(seconds=c10d_timeout_s)  # new_group's own default is 10 min
        self.rank = dist.get_rank()
        self.sync = common.gloo_group()  # barriers while NCCL groups sleep
        self.out_dir = None  # the case's folder: markers for the driver, results

    def groups(self, *roles: str) -> dict:
        """New groups over all ranks named by role, each communicator created."""
        from amem_callbacks import name_group

        out = {}
        for role in roles:
            out[role] = self.dist.new_group(list(range(self.dist.get_world_size())),
                                            timeout=self.timeout)
            name_group(out[role], role)
        for group in out.values():
            assert self.exact(group, 1.0)
        return out

    def exact(self, group, value: float) -> bool:
        from tests.gpu.common import exact_allreduce

        return exact_allreduce(group, value, self.device, numel=(1 << 20) if not CPU else 64)

    def barrier(self) -> None:
        self.dist.barrier(group=self.sync)

    def backend(self, name: str = "nccl"):
        """``name``; in CPU mode the fake NCCL's backend (common.policy_backend)."""
        return common.policy_backend(name)

    def fake(self):
        """CPU mode: the fake NCCL behind every gloo group of this process but the
        sync group (common.fake_nccl)."""
        return common.fake_nccl(default_mib=64)

    def free(self) -> int:
        """The GPU's memory not held by this process (common.unheld_bytes: NCCL's
        freed bytes show, other jobs on the GPU do not, where NVML counts processes)."""
        if CPU:
            return 0
        from tests.gpu.common import unheld_bytes

        return unheld_bytes()[0]

    @staticmethod
    def total(policy, name: str) -> int:
        """A running total of the policy's public figures (``amem/total/<name>``)."""
        return policy.metrics(last=False)[f"amem/total/{name}"]

    @staticmethod
    def inert(policy) -> bool:
        return bool(policy.metrics()["amem/inert"])

    def policy(self, **options):
        from amem_callbacks import OffloadPolicy

        options.setdefault("backend", self.backend())
        options.setdefault("agree_timeout_s", 60)
        if not CPU:
            options.setdefault("device", self.torch.cuda.current_device())
        return OffloadPolicy(**options)


class WarningLines(logging.Handler):
    """The package's WARNING/ERROR lines, to count the 'why and how to fix' line."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []
        logging.getLogger("amem_callbacks").addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def close(self):
        logging.getLogger("amem_callbacks").removeHandler(self)
        super().close()


def group_actions(report) -> dict:
    return {g.name: g.action for g in report.groups}


# --- the cases -----------------------------------------------------------
@case(f"{4 if QUICK else 20} random interleavings of begin/end and collectives on suspended, kept and "
      "transitioning groups (overlap on, 1 and 4 workers): zero faults, every result exact", 420)
def interleavings(r: Rank, seeds: int = 4 if QUICK else 20, actions: int = 12) -> dict:
    """Collectives race transitions that run on worker threads. A spy sits under
    the guard and records any call that reaches a group the policy has not
    finished resuming; a call that reached a suspended NCCL communicator would
    kill the process (then the case fails by its exit code)."""
    from amem_callbacks.states import Status
    from tests.random_program import run_random_program

    groups = r.groups("dp", "ep", "tp")
    current = {}
    violations, spied = [], []
    cls = r.dist.ProcessGroup
    raw = cls.__dict__["allreduce"]  # put back as it was
    original = cls.allreduce

    # The guard wraps ProcessGroup methods at class level while a group is watched,
    # and calls whatever method it found there: set first, the spy runs under it
    # and sees exactly the calls the guard let through to the communicator.
    def spy(group, *args, **kwargs):
        policy = current.get("policy")
        view = policy.view(group) if policy else None
        spied.append(1)
        if view is not None and view.status is not Status.ACTIVE:
            violations.append(view.name)
        return original(group, *args, **kwargs)

    cls.allreduce = spy
    runs = []
    try:
        for seed in range(seeds):
            workers = 1 if seed % 2 == 0 else 4
            policy = current["policy"] = r.policy(keep=["tp"], overlap=True, workers=workers,
                                                  groups=list(groups.values()))
            same = random.Random(seed)  # the same program on every rank
            jitter = random.Random(1000 * seed + r.rank)  # different timing per rank
            trace, exact = run_random_program(policy, groups, r.exact, same, jitter, actions,
                                              max_sleep_s=0.05)
            policy.close()
            exact.append(all(r.exact(g, 11.0) for g in groups.values()))
            runs.append({"seed": seed, "workers": workers, "trace": trace, "exact": all(exact),
                         "auto_resumes": r.total(policy, "auto_resumes"),
                         "suspends": r.total(policy, "group_suspends"),
                         "failures": r.total(policy, "failures")})
            r.barrier()
    finally:
        cls.allreduce = raw
    ok = not violations and all(run["exact"] and not run["failures"] for run in runs)
    return {"ok": ok and len(runs) == seeds and bool(spied), "violations": violations,
            "all_reduces_seen_by_the_spy": len(spied), "runs": runs,
            "total_suspends": sum(run["suspends"] for run in runs),
            "total_auto_resumes": sum(run["auto_resumes"] for run in runs)}


@case("ranks disagree on the plan (different keep-sets): the disputed group stays active "
      "on every rank, the rest is suspended, training continues", 120)
def disagreement(r: Rank) -> dict:
    groups = r.groups("dp", "ep", "tp")
    keep = ["tp"] if r.rank == 0 else ["tp", "ep"]
    policy = r.policy(keep=keep, groups=list(groups.values()))
    begin = policy.begin("rollout")
    during = {"tp": r.exact(groups["tp"], 2.0), "ep": r.exact(groups["ep"], 3.0)}
    r.barrier()
    policy.end("rollout")
    after = all(r.exact(g, 4.0) for g in groups.values())
    actions = group_actions(begin)
    reasons = {g.name: g.reason for g in begin.groups}
    ok = (actions.get("ep") == "kept" and actions.get("dp") in ("suspended", "would suspend")
          and actions.get("tp") == "kept" and all(during.values()) and after)
    return {"ok": ok, "actions": actions, "reasons": reasons, "exact_during": during,
            "exact_after": after, "agree_s": begin.agree_seconds}


@case("NCCL refuses, on one rank alone, a suspend of a suspended communicator and a resume of "
      "an active one: at once (usage error), without waiting for the other ranks; the package "
      "reads both as leaving the communicator as it was, and it works after", 90)
def refused_on_one_rank(r: Rank) -> dict:
    """What transitions' failure handling rests on (errors.suspend_left_comm_as_it_was):
    NCCL's usage checks come before its members meet (src/mem_manager.cc), so a refusal
    on one rank neither waits for the others nor changes the communicator. Were it to
    wait, rank 0 would hang here while rank 1 sits in a gloo barrier: the case's limit
    fails it."""
    from amem_callbacks.backends.nccl import NcclBackend
    from amem_callbacks.errors import NcclError, suspend_left_comm_as_it_was

    group = r.groups("dp")["dp"]
    fake = r.fake() if CPU else None
    # ctypes: NCCL's own result codes (torch's suspend() gives none)
    backend = (NcclBackend(library=fake.library, handle_of=fake.handle_of) if fake
               else NcclBackend(path="ctypes"))
    backend.check()
    if not CPU:
        backend.device = r.torch.cuda.current_device()
    handle, why = backend.communicator(group)
    if handle is None:
        return {"ok": False, "why": f"no communicator handle: {why}"}

    def refused_alone(call) -> dict:
        out = {}
        if r.rank == 0:
            start = time.monotonic()
            try:
                call(handle)
                out["error"] = None
            except NcclError as exc:
                out.update(error=str(exc), code=exc.code, as_it_was=suspend_left_comm_as_it_was(exc))
            out["seconds"] = round(time.monotonic() - start, 4)
        r.barrier()  # the other ranks are in no NCCL call meanwhile
        return out

    backend.suspend(handle)  # every rank: the communicator is suspended
    r.barrier()
    second_suspend = refused_alone(backend.suspend)
    backend.resume(handle)  # every rank: active again
    after_suspend_refused = r.exact(group, 2.0)
    r.barrier()
    resume_while_active = refused_alone(backend.resume)
    after_resume_refused = r.exact(group, 3.0)
    refusals = (second_suspend, resume_while_active)
    ok = after_suspend_refused and after_resume_refused and (r.rank != 0 or all(
        o.get("code") in NcclError.USAGE_CODES and o["as_it_was"] and o["seconds"] < 5.0
        for o in refusals))
    return {"ok": ok, "second_suspend_on_rank_0": second_suspend,
            "resume_while_active_on_rank_0": resume_while_active,
            "exact_after": [after_suspend_refused, after_resume_refused]}


@case("host memory: NCCL's pinned host copy reported per group; a cap leaves the groups "
      "past it active", 120)
def host_cap(r: Rank) -> dict:
    groups = r.groups("dp", "ep", "cp", "tp")
    probe = r.policy(keep=["tp"], groups=list(groups.values()))
    sizes = {g.name: g.suspendable_bytes for g in probe.begin("rollout").groups
             if g.action != "kept"}
    r.barrier()
    probe.end("rollout")
    cap = sorted(sizes.values())[0] + sorted(sizes.values())[1]  # room for two groups
    policy = r.policy(keep=["tp"], host_memory_cap_bytes=cap, groups=list(groups.values()))
    begin = policy.begin("rollout")
    suspended = {g.name: g.suspendable_bytes for g in begin.suspended}
    capped = [g.name for g in begin.kept if "host memory cap" in g.reason]
    rss_rise = begin.host_rss_delta
    r.barrier()
    policy.end("rollout")
    exact = all(r.exact(g, 5.0) for g in groups.values())
    ok = (len(suspended) == 2 and len(capped) == 1 and sum(suspended.values()) <= cap and exact)
    return {"ok": ok, "bytes_per_group": sizes, "cap": cap, "suspended": suspended,
            "kept_by_cap": capped, "host_rss_rise": rss_rise, "exact_after": exact}


@case("a small DDP run with and without offload, same seeds: bit-identical losses and "
      "parameters", 180)
def ddp_identical(r: Rank, steps: int = 8) -> dict:
    torch = r.torch
    groups = r.groups("dp", "ep", "tp")

    def train(with_policy: bool):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(),
                                  torch.nn.Linear(512, 1)).to(r.device)
        model = torch.nn.parallel.DistributedDataParallel(net)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        policy = r.policy(keep=["tp"]) if with_policy else None
        data = torch.Generator(device=r.device).manual_seed(r.rank)
        losses = []
        for _step in range(steps):
            x = torch.randn(64, 256, generator=data, device=r.device)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()  # DDP's C++ reducer: bypasses the guard, end() must resume first
            optimizer.step()
            losses.append(loss.item())
            if policy is not None:
                policy.begin("rollout")
                for _ in range(4):  # "generation"
                    x @ torch.randn(256, 256, device=r.device)
                r.exact(groups["tp"], 1.0)  # the kept group works meanwhile
                r.barrier()
                policy.end("rollout")
        return losses, [p.detach().clone() for p in model.parameters()], policy

    base_losses, base_params, _ = train(False)
    losses, params, policy = train(True)
    same_params = all(torch.equal(a, b) for a, b in zip(params, base_params))
    return {"ok": losses == base_losses and same_params and r.total(policy, "group_suspends") > 0,
            "losses_equal": losses == base_losses, "params_equal": same_params,
            "losses": losses, "suspends": r.total(policy, "group_suspends")}


@case(f"{30 if QUICK else 200} begin/end cycles: device free memory and host RSS flat within 1 % after warm-up, "
      "every result exact", 420)
def cycles(r: Rank, n: int = 30 if QUICK else 200, warmup: int = 5 if QUICK else 20) -> dict:
    from amem_callbacks.memory import host_rss_bytes

    groups = r.groups("dp", "tp")
    policy = r.policy(keep=["tp"], groups=list(groups.values()))
    during, after, rss, threads, exact = [], [], [], [], True
    for cycle in range(n):
        policy.begin("rollout")
        during.append(r.free())
        exact &= r.exact(groups["tp"], cycle % 5 + 1.0)
        r.barrier()
        policy.end("rollout")
        exact &= r.exact(groups["dp"], cycle % 7 + 1.0)
        after.append(r.free())
        rss.append(host_rss_bytes())
        threads.append(threading.active_count())
    total = r.torch.cuda.mem_get_info()[1] if not CPU else 1

    def spread(xs):
        return max(xs[warmup:]) - min(xs[warmup:])

    flat_device = spread(after) <= 0.01 * total and spread(during) <= 0.01 * total
    flat_rss = spread(rss) <= 0.01 * rss[warmup]
    freed = [d - a for d, a in zip(during, after)]
    return {"ok": exact and flat_device and flat_rss and spread(threads) == 0
            and r.total(policy, "group_suspends") == n,
            "cycles": n, "warmup": warmup, "device_total": total,
            "device_free_after_end_spread": spread(after), "device_free_during_spread": spread(during),
            "freed_per_cycle_min_max": [min(freed[warmup:]), max(freed[warmup:])],
            "host_rss_spread": spread(rss), "host_rss_after_warmup": rss[warmup],
            "host_rss_last": rss[-1], "threads_spread": spread(threads), "exact": exact,
            "suspends": r.total(policy, "group_suspends")}


def _unusable(r: Rank, backend: str, words: list, backend_options=None) -> dict:
    """One policy that cannot work here: one WARNING line with the reason and
    the fix, nothing suspended, the same memory, exact results."""
    groups = r.groups("dp", "tp")
    lines = WarningLines()
    policy = r.policy(backend=r.backend(backend), backend_options=backend_options)
    free_before = r.free()
    skipped, exact = [], True
    for cycle in range(3):
        begin = policy.begin("rollout")
        skipped.append(begin.skipped is not None)
        exact &= all(r.exact(g, cycle + 1.0) for g in groups.values())
        policy.end("rollout")
    moved = r.free() - free_before
    lines.close()
    found = {word: bool(lines.lines) and word in lines.lines[0] for word in words}
    ok = (r.inert(policy) and all(skipped) and exact and len(lines.lines) == 1
          and all(found.values()) and abs(moved) < 64 * MiB)
    return {"ok": ok, "inert": r.inert(policy), "lines": lines.lines, "words_found": found,
            "exact": exact, "device_free_change": moved}


@case("NCCL older than 2.29.7 (torch's own NCCL, no preload): one line with why and the "
      "fix, training unchanged", 120, env={"LD_PRELOAD": None}, gpu_only=True)
def old_nccl(r: Rank) -> dict:
    from amem_callbacks.nccl_library import SUSPEND_MIN_VERSION, NcclLibrary

    r.groups("world_probe")  # makes torch load its NCCL
    lib = NcclLibrary.loaded()
    if lib.has_suspend and lib.version >= SUSPEND_MIN_VERSION:
        return {"ok": None, "not_applicable": f"torch's own NCCL is {lib.version_str}: "
                                              "new enough, nothing to test"}
    result = _unusable(r, "auto", ["needs NCCL >=", "pip install"])
    result["nccl"] = f"{lib.version_str} ({lib.path})"
    return result


@case("NCCL_CUMEM_ENABLE=0: one line with why and the fix, training unchanged", 120,
      env={"NCCL_CUMEM_ENABLE": "0"})  # on CPU the fake NCCL's nccl backend refuses it alike
def cumem_off(r: Rank) -> dict:
    return _unusable(r, "auto", ["NCCL_CUMEM_ENABLE=0", "unset NCCL_CUMEM_ENABLE"])


@case("AMem asked for but missing, and AMem at a wrong library path: one line each with "
      "why and the fix, training unchanged", 120, gpu_only=True)
def amem_unusable(r: Rank) -> dict:
    missing = _unusable(r, "amem", ["is not AMem's", "LD_LIBRARY_PATH"])
    wrong = _unusable(r, "amem", ["/nonexistent/amem/libnccl.so.2"],
                      backend_options={"amem": {"library_path": "/nonexistent/amem/libnccl.so.2"}})
    return {"ok": missing["ok"] and wrong["ok"], "missing": missing, "wrong_path": wrong}


@case("a rank dies while groups are suspended: the survivor fails with an error naming "
      "the groups within twice the c10d timeout (30 s) plus the agreement timeout (10 s), "
      "no hang", 200, victims=(1,))
def rank_dies(r: Rank) -> dict:
    groups = r.groups("dp", "ep", "tp")
    policy = r.policy(keep=["tp"], groups=list(groups.values()), agree_timeout_s=10)
    policy.begin("rollout")
    r.barrier()
    if r.rank == 1:
        os._exit(0)  # dies mid-phase without a word
    time.sleep(1.0)
    print("rank 0: peer gone, calling end()", flush=True)
    start = time.monotonic()
    lines = WarningLines()
    outcome = {}
    try:
        report = policy.end("rollout")
        outcome["end"] = {g.name: [g.action, g.error or g.reason] for g in report.groups}
    except Exception as exc:  # noqa: BLE001 - what the survivor sees is the result
        outcome["end_error"] = f"{type(exc).__name__}: {exc}"
    outcome["end_s"] = time.monotonic() - start
    print(f"rank 0: end() done after {outcome['end_s']:.1f} s: {outcome}", flush=True)
    try:  # the next use of a group the dead rank was in must raise, not hang
        r.exact(groups["dp"], 1.0)
        outcome["next_call"] = "returned"
    except Exception as exc:  # noqa: BLE001
        outcome["next_call"] = f"{type(exc).__name__}: {exc}"
    outcome["total_s"] = time.monotonic() - start
    outcome["log_lines"] = lines.lines
    text = json.dumps(outcome)
    outcome["ok"] = outcome["total_s"] < 2 * 30 + 10 + 20 and "'dp'" in text and \
        outcome["next_call"] != "returned"
    return outcome


# --- faults inside the NCCL call ------------------------------------------
# ncclCommSuspend starts with a bootstrap barrier over the communicator's ranks,
# and ncclCommResume restores its local buffers and then waits in one. So a
# rank that enters first waits inside the call for the others: the victim
# (the last rank; rank 0 hosts the c10d store and must live) enters at once,
# the survivors 2 s later, and the driver kills the victim 0.2 s after its
# marker, while it waits in the barrier. The survivors then enter a barrier
# whose peer is dead: NCCL either fails the call (the peer's socket closed) or
# waits forever; the policy's deadline bounds the second case.
# On CPU the fake NCCL has no barrier: its gate (suspend) and delay (resume)
# hold every rank inside the call the way the barrier would.
KILL_AFTER_S = float(os.environ.get("AMEM_KILL_AFTER_S", "0.2"))
LATE_S = 2.0  # how much later than the victim the survivors enter the NCCL call
FAULT_TIMEOUT_S, FAULT_AGREE_S = (8.0, 4.0) if CPU else (20.0, 10.0)
FAULT_BOUND_S = FAULT_TIMEOUT_S + 2 * FAULT_AGREE_S + 5  # timeout_s + agreement + slack
STOP_S = 2.5 * FAULT_AGREE_S + 3  # longer than both agreement deadlines
RESTART_NOTE = (
    "What a restarted job needs: every rank restarts (the launcher relaunches the whole job, "
    "e.g. torchrun --max-restarts, or the job fails and is resubmitted) and resumes from its "
    "last checkpoint. A member died inside ncclCommSuspend/Resume, so on the survivors that "
    "communicator is stuck in NCCL's barrier (a worker thread stays inside the call) or failed "
    "half-way, its buffers released or restored on some ranks only: it cannot be resumed, "
    "reused or safely destroyed, only abandoned with the process. The survivors end their "
    "process after the error (here: os._exit after writing the result); the new job creates "
    "fresh communicators and a fresh OffloadPolicy (learned keeps start empty). Not covered: "
    "the death of rank 0, which hosts the c10d store the agreement uses.")


def _mark(r: Rank, event: str) -> None:
    with open(os.path.join(r.out_dir, f"rank{r.rank}.{event}"), "w") as f:
        f.write(repr(time.time()))


def _faulty_backend(r: Rank, op: str, victim: int):
    """The nccl backend, its ``op`` ("suspend" or "resume") staged: the victim
    marks entering and leaving the call, the survivors enter LATE_S later."""
    from amem_callbacks.backends.nccl import NcclBackend

    fake = r.fake() if CPU else None

    class Faulty(NcclBackend):
        def suspend(self, handle):
            self._staged("suspend", handle, super().suspend)

        def resume(self, handle):
            self._staged("resume", handle, super().resume)

        def _staged(self, name, handle, call):
            if name != op:
                return call(handle)
            if r.rank == victim:
                _mark(r, f"in-{name}")
            else:
                time.sleep(LATE_S)
            if fake is not None:  # hold the call as NCCL's barrier would
                if name == "suspend":
                    fake.controls.set_gate(handle)
                else:
                    fake.controls.delay(handle, 60_000_000)
            call(handle)
            if r.rank == victim:
                _mark(r, f"out-{name}")

    return Faulty(library=fake.library, handle_of=fake.handle_of) if fake else Faulty()


def _reached(proc, marker: str, facts: dict, why: str, limit_s: float = 240.0) -> bool:
    """Driver side: wait until a rank wrote ``marker`` (False, with ``why``, if it
    died or took longer than ``limit_s``)."""
    start = time.monotonic()
    while not os.path.exists(marker):
        if proc.poll() is not None or time.monotonic() - start > limit_s:
            facts.update(ok=False, why=why)
            return False
        time.sleep(0.005)
    return True


def _kill_inside(op: str):
    """Driver side: SIGKILL the victim KILL_AFTER_S after it entered ``op``."""
    def during(procs, out_dir, facts):
        victim = len(procs) - 1
        entered = os.path.join(out_dir, f"rank{victim}.in-{op}")
        left = os.path.join(out_dir, f"rank{victim}.out-{op}")
        if not _reached(procs[victim], entered, facts, f"rank {victim} never entered the {op} call"):
            return
        seen = time.monotonic()
        time.sleep(KILL_AFTER_S)
        inside = not os.path.exists(left) and procs[victim].poll() is None
        os.kill(procs[victim].pid, signal.SIGKILL)
        facts.update(victim=victim, killed_s_after_entry=round(time.monotonic() - seen, 3),
                     inside_call_at_kill=inside)
        if not inside:
            facts.update(ok=False, why=f"the kill landed after the {op} call returned: rerun "
                                       "with AMEM_KILL_AFTER_S=0")
    return during


def _kill_case(r: Rank, op: str) -> dict:
    victim = r.dist.get_world_size() - 1
    groups = r.groups("dp", "ep", "tp")
    policy = r.policy(backend=_faulty_backend(r, op, victim), keep=["tp"], workers=1,
                      groups=list(groups.values()), timeout_s=FAULT_TIMEOUT_S,
                      agree_timeout_s=FAULT_AGREE_S)
    lines = WarningLines()
    # every rank reaches the staged call's agreement together: on a loaded machine a
    # rank later than agree_timeout_s there keeps every group, and the victim would
    # never enter the call
    r.barrier()
    if op == "resume":
        policy.begin("rollout")  # suspends as usual: only the resume is staged
        r.barrier()
    start = time.monotonic()
    outcome = {"victim": victim, "bound_s": FAULT_BOUND_S, "timeout_s": FAULT_TIMEOUT_S,
               "agree_timeout_s": FAULT_AGREE_S, "survivors_late_s": LATE_S}
    try:  # the victim is killed in here
        report = policy.begin("rollout") if op == "suspend" else policy.end("rollout")
        outcome["returned"] = {g.name: [g.action, g.error or g.reason] for g in report.groups}
    except Exception as exc:  # noqa: BLE001 - what the survivor sees is the result
        outcome["raised"] = f"{type(exc).__name__}: {exc}"
    outcome["call_s"] = round(time.monotonic() - start, 2)
    print(f"rank {r.rank}: {op} gave {outcome} after {outcome['call_s']} s", flush=True)
    if policy.view(groups["dp"]) is not None:  # the guard holds the group: the next call must raise, not hang
        began = time.monotonic()
        try:
            r.exact(groups["dp"], 1.0)
            outcome["next_call"] = "returned"
        except Exception as exc:  # noqa: BLE001
            outcome["next_call"] = f"{type(exc).__name__}: {exc}"
        outcome["next_call_s"] = round(time.monotonic() - began, 2)
    else:  # marked active after NCCL's error: a call would wait in NCCL for the dead peer
        outcome["next_call"] = ("not tried: the group is marked active, so a call would reach "
                                "NCCL and wait for the dead peer until the c10d timeout")
    outcome["log_lines"] = lines.lines
    lines.close()
    raised = outcome.get("raised", "")
    returned = {n: v for n, v in outcome.get("returned", {}).items() if n != "tp"}
    # Either outcome names the groups and is bounded; only the first raises. With the
    # second, begin/end return and a caller that ignores the report meets the dead peer
    # at its next collective on that group (torch's c10d timeout then ends it).
    timed_out = "TransitionTimeout" in raised and any(f"'{g}'" in raised for g in ("dp", "ep"))
    nccl_failed = bool(returned) and all(v[0] == "failed" for v in returned.values())
    outcome["survivor_saw"] = (
        "TransitionTimeout naming the groups (the policy's deadline)" if timed_out else
        "NCCL failed the call (dead peer): the groups FAILED in the report, one ERROR line "
        "each, no exception" if nccl_failed else raised or "no error")
    outcome["restart"] = RESTART_NOTE
    outcome["ok"] = ((timed_out or nccl_failed) and outcome["call_s"] <= FAULT_BOUND_S
                     and outcome.get("next_call") != "returned")
    return outcome


@case(f"a rank is SIGKILLed inside ncclCommSuspend (3 ranks): each survivor gets an error "
      f"naming the groups within timeout_s + 2 x agree_timeout_s + 5 s ({FAULT_BOUND_S:g} s), "
      "no hang; the survivor process can still exit", 150, ranks=3, victims=(2,),
      during=_kill_inside("suspend"), exit_probe=True)
def kill_in_suspend(r: Rank) -> dict:
    return _kill_case(r, "suspend")


@case(f"a rank is SIGKILLed inside ncclCommResume (3 ranks): each survivor gets an error "
      f"naming the groups within {FAULT_BOUND_S:g} s, the next call on the group raises, no "
      "hang; the survivor process can still exit", 180, ranks=3, victims=(2,),
      during=_kill_inside("resume"), exit_probe=True)
def kill_in_resume(r: Rank) -> dict:
    return _kill_case(r, "resume")


def _stop_at_begin(procs, out_dir, facts):
    """Driver side: SIGSTOP the victim as it reaches begin, SIGCONT it STOP_S later."""
    victim = len(procs) - 1
    marker = os.path.join(out_dir, f"rank{victim}.at-begin")
    if not _reached(procs[victim], marker, facts, f"rank {victim} never reached begin"):
        return
    os.kill(procs[victim].pid, signal.SIGSTOP)
    time.sleep(STOP_S)
    os.kill(procs[victim].pid, signal.SIGCONT)
    facts.update(victim=victim, stopped_s=STOP_S)


@case(f"a rank is SIGSTOPped at begin for {STOP_S:g} s (longer than the agreement timeout "
      "of both leader and members), then continued (3 ranks): the others' begin returns "
      "within the agreement timeout keeping every group (no hang, nothing suspended under a "
      "stopped peer); the stopped rank's begin then keeps them too, saying it was late; the "
      "next cycle suspends and resumes as usual, every result exact", 150, ranks=3,
      during=_stop_at_begin)
def stop_in_begin(r: Rank) -> dict:
    victim = r.dist.get_world_size() - 1
    groups = r.groups("dp", "ep", "tp")
    policy = r.policy(keep=["tp"], groups=list(groups.values()), timeout_s=FAULT_TIMEOUT_S,
                      agree_timeout_s=FAULT_AGREE_S)
    # A first cycle with everyone on time: the first begin also agrees on the backend,
    # and a rank late there leaves the policy inert on every rank for good (seen in
    # CPU mode: "not every rank can use backend 'nccl' (rank(s) [2] did not reach ...)").
    policy.begin("rollout")
    r.barrier()
    policy.end("rollout")
    setup_ok = all(r.exact(g, 1.0) for g in groups.values()) and not r.inert(policy)
    r.barrier()
    if r.rank == victim:
        _mark(r, "at-begin")
        time.sleep(0.5)  # stopped here by the driver, before it votes (gloo-free)
    start = time.monotonic()
    begin = policy.begin("rollout")
    begin_s = time.monotonic() - start
    kept = {g.name: g.reason for g in begin.kept}
    policy.end("rollout")
    r.barrier()  # over gloo: waits for the stopped rank
    exact_after = all(r.exact(g, 2.0) for g in groups.values())
    second = policy.begin("rollout")  # everyone on time again: the rounds still line up
    exact_during = r.exact(groups["tp"], 3.0)
    r.barrier()
    policy.end("rollout")
    exact_second = all(r.exact(g, 4.0) for g in groups.values())
    late_named = all(f"[{victim}]" in reason and "did not reach" in reason
                     for name, reason in kept.items() if name != "tp")
    result = {"victim": victim, "i_am_victim": r.rank == victim, "setup_cycle_ok": setup_ok,
              "begin_s": round(begin_s, 2),
              "stopped_s": STOP_S, "agree_timeout_s": FAULT_AGREE_S,
              "first_begin": group_actions(begin), "kept_reasons": kept,
              "second_begin": group_actions(second), "exact_after": exact_after,
              "exact_during_second": exact_during, "exact_after_second": exact_second,
              "suspends": r.total(policy, "group_suspends")}
    if r.rank == victim:
        result["what_the_stopped_rank_sees"] = (
            f"begin returned after {begin_s:.2f} s, no error: every group kept, reason "
            f"{kept.get('dp')!r}")
    on_time = r.rank == victim or begin_s <= 2 * FAULT_AGREE_S + 3 < STOP_S
    result["ok"] = (setup_ok and on_time and not begin.suspended and kept.keys() >= {"dp", "ep"}
                    and late_named and exact_after
                    and exact_during and exact_second
                    and set(n for n, a in result["second_begin"].items() if a == "suspended")
                    == {"dp", "ep"})
    return result


# --- rank process --------------------------------------------------------
def rank_main(name: str, out_dir: str) -> None:
    sys.path.insert(0, ROOT)
    spec = CASES[name]
    import faulthandler

    faulthandler.dump_traceback_later(max(5, spec.limit_s - 20))  # a hang leaves every stack
    r = Rank(c10d_timeout_s=30 if name == "rank_dies" else spec.limit_s)
    r.out_dir = out_dir
    try:
        result = spec.fn(r)
    except Exception as exc:  # recorded, and the exit code says it failed
        import traceback

        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{r.rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    if spec.exit_probe:
        _exit_probe(r)
    elif not spec.victims:
        try:
            r.barrier()  # every result written before any process leaves
        except Exception:
            pass
    sys.stdout.flush()
    os._exit(0 if result.get("ok") is not False else 1)


def _exit_probe(r: Rank) -> None:
    """Can a survivor leave normally while a worker thread may sit inside NCCL?
    Try destroy_process_group() on a thread (it may wait for the stuck group up to
    timeout_s) and write what happened;
    faulthandler's watchdog (a C thread, no GIL needed) ends the process if
    the attempt blocks while holding the GIL. The caller then os._exit()s."""
    import faulthandler

    path = os.path.join(r.out_dir, f"rank{r.rank}.exit.json")

    def note(text):
        with open(path, "w") as f:
            json.dump({"destroy_process_group": text}, f)

    wait_s = FAULT_TIMEOUT_S + 5
    note(f"called; the process ended inside it (a crash, or faulthandler's {wait_s + 10:g} s "
         "watchdog: see the exit code)")
    faulthandler.dump_traceback_later(wait_s + 10, exit=True)
    done, errors, start = threading.Event(), [], time.monotonic()

    def destroy():
        try:
            r.dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")
        done.set()

    threading.Thread(target=destroy, daemon=True).start()
    if done.wait(wait_s):
        note(f"returned in {time.monotonic() - start:.1f} s"
             + (f", raising {errors[0]}" if errors else ""))
    else:
        note(f"still blocked after {wait_s:g} s (the process then left with os._exit)")
    faulthandler.cancel_dump_traceback_later()


# --- driver --------------------------------------------------------------

def run_case(name: str) -> dict:
    spec = CASES[name]
    out_dir = tempfile.mkdtemp(prefix=f"amem-rel-{name}-")
    from amem_callbacks.tools.launch import free_port
    port = free_port()
    procs, logs = [], []
    for rank in range(spec.ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(spec.ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_MULTI_RANK_GPU_ENABLE="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for key, value in spec.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-case",
                                       name, out_dir], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    start = time.monotonic()
    facts = {}  # what the driver-side fault did
    fault = None
    if spec.during is not None:
        fault = threading.Thread(target=spec.during, args=(procs, out_dir, facts), daemon=True)
        fault.start()
    hung = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, spec.limit_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            hung = True
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if fault is not None:
        fault.join(5)
    for log in logs:
        log.close()
    seconds = time.monotonic() - start
    ranks, exits = [], {}
    for rank in range(spec.ranks):
        path = os.path.join(out_dir, f"rank{rank}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else None)
        path = os.path.join(out_dir, f"rank{rank}.exit.json")
        if os.path.exists(path):
            exits[rank] = json.load(open(path))["destroy_process_group"]
    tails = [open(os.path.join(out_dir, f"rank{k}.log")).read()[-3000:] for k in range(spec.ranks)]
    # ranks that die on purpose are not judged
    considered = [res for rank, res in enumerate(ranks) if rank not in spec.victims]
    verdicts = [None if res is None else res.get("ok") for res in considered]
    if hung or facts.get("ok") is False:
        ok = False
    elif any(v is None for v in verdicts) and all(res is not None for res in considered):
        ok = None  # not applicable here
    else:
        ok = all(v is True for v in verdicts)
    row = {"case": name, "must_hold": spec.must_hold, "ok": ok, "seconds": round(seconds, 1),
           "hung_past_limit_s": spec.limit_s if hung else None,
           "exit_codes": [p.returncode for p in procs], "ranks": ranks}
    if spec.during is not None:
        row["driver"] = facts
    if spec.exit_probe:
        row["survivor_exit"] = {rank: f"destroy_process_group(): {text}; then os._exit(0) "
                                      f"(exit code {procs[rank].returncode})"
                                for rank, text in exits.items()}
    if not ok:
        row["log_tails"] = tails
    return row


def driver(out_path: str, only: list) -> int:
    import torch

    from amem_callbacks.nccl_library import NcclLibrary

    names = only or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {sorted(CASES)}")
    if not CPU:
        torch.cuda.init()
    lib = NcclLibrary.loaded() if not CPU else None
    rows = []
    for name in names:
        if name == "old_nccl" and not CPU and torch.cuda.device_count() < 2:
            rows.append({"case": name, "must_hold": CASES[name].must_hold, "ok": None, "seconds": 0,
                         "skipped": "torch's own NCCL (2.28.9) refuses two ranks on one GPU: "
                                    "this case needs two GPUs"})
            continue
        row = run_case(name)
        rows.append(row)
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[row["ok"]]
        print(f"{verdict:4}  {name:16} {row['seconds']:7.1f} s  {row['must_hold']}", flush=True)
        if row["ok"] is False:  # why, where the run's own output is all there is (CI)
            print(json.dumps({"driver": row.get("driver"), "exit_codes": row["exit_codes"],
                              "hung_past_limit_s": row["hung_past_limit_s"]}), flush=True)
            for rank, tail in enumerate(row.get("log_tails", [])):
                print(f"--- rank {rank}, the log's last 3000 characters\n{tail}", flush=True)
        write_table(out_path, rows, lib, complete=len(rows) == len(names))
    return 0 if all(row["ok"] is not False for row in rows) else 1


def write_table(out_path: str, rows: list, lib, complete: bool) -> None:
    """Rewritten after every case: a run cut short still leaves what it measured."""
    import torch

    result = {
        "command": "LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONPATH=$PWD python3 "
                   "tests/gpu/reliability_gpu.py " + " ".join(sys.argv[1:]),
        "mode": "cpu-fake" if CPU else "gpu",
        "quick": QUICK,
        "torch": torch.__version__,
        "gpus": torch.cuda.device_count() if not CPU else 0,
        "nccl_preloaded": os.environ.get("LD_PRELOAD"),
        "nccl_loaded_by_driver": lib.version_str if lib else None,
        "complete": complete,
        "ok": complete and all(row["ok"] is not False for row in rows),
        "table": [{k: row[k] for k in ("case", "ok", "seconds", "must_hold")} for row in rows],
        "cases": rows,
        **common.provenance("tests/gpu/reliability_gpu.py"),
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-case":
        rank_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(driver(sys.argv[1], sys.argv[2:]))
