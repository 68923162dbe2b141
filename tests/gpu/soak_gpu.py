"""Soak on real NCCL: Megatron-shaped groups (>= 16 per rank), learned keeps on,
overlap on, 4 workers; begin/end cycles for a fixed wall budget, every cycle
checked exact, memory, pinned bytes and threads read every 10 cycles and
judged flat after warm-up.

GPU (one H200 is enough: several ranks on one GPU need NCCL >= 2.30; the
driver sets NCCL_MULTI_RANK_GPU_ENABLE=1 and small NCCL buffers, see NCCL_ENV):
    LD_PRELOAD=/path/libnccl.so.2 PYTHONPATH=$PWD python3 tests/gpu/soak_gpu.py \\
        --out OUT/soak.json [--seconds 480] [--ranks 4]
(the committed run: results/one_h200/soak_real_nccl, listed in results/README.md)
CPU check of this script (gloo ranks, the fake NCCL of tests/fake_nccl; --cpu, or
the GPU scripts' shared CPU mode AMEM_GPU_DRIVER_ON_CPU=1, or AMEM_SOAK_CPU=1):
    AMEM_GPU_DRIVER_ON_CPU=1 python tests/gpu/soak_gpu.py --out /tmp/soak.json --seconds 10
(at scale: results/cpu/soak_fake_nccl_1200_cycles)
Plot (wherever matplotlib is):
    python tests/gpu/plot_soak.py results/one_h200/soak_real_nccl/soak.json

One file is driver and rank program, like reliability_gpu.py: the driver starts
the ranks, bounds the whole run by --wall (a hang is a failure: every rank is
killed) and writes one JSON with the series, the verdicts, the exact command
and the versions. While NCCL groups are suspended, ranks synchronise over a
gloo group only: a collective on a suspended NCCL communicator kills the process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Small communicators: transitions stay short (more cycles per budget) and the
# pinned host copies of 4 ranks x 18 groups stay small. A value the caller set wins.
NCCL_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_BUFFSIZE": str(1 << 20),
            "NCCL_MAX_NCHANNELS": "2", "NCCL_MAX_P2P_NCHANNELS": "2",
            "NCCL_NCHANNELS_PER_NET_PEER": "1"}
KEEP = ["tp", "mp"]  # rollout uses them (as Megatron's in-place inference does)
DISPUTED = "dp"  # the role one rank alone keeps on disagreement cycles
TP_LIKE = ("tp", "mp", "tp_cp", "ep", "tp_ep")  # blocks of consecutive ranks
DP_LIKE = ("dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp")  # strided ranks
WARMUP_FRACTION, FLAT_TOLERANCE = 0.10, 0.01
SHARED_GPU_WHY = ("--shared-gpu: other jobs use this GPU, so its free memory is theirs too; "
                  "judged on device_process_* (this process's own bytes) instead")
# name -> (reading point, key): the series judged flat, per rank
SERIES = {
    "device_free_after_end": ("after", "device_free"),
    "device_free_during": ("during", "device_free"),
    "device_process_after_end": ("after", "device_process"),
    "device_process_during": ("during", "device_process"),
    "host_rss_after_end": ("after", "rss"),
    "host_rss_during": ("during", "rss"),
    "pinned_nccl_suspended_bytes_during": ("during", "suspended_bytes"),
    "vmlck_during": ("during", "vmlck"),
    "vmpin_during": ("during", "vmpin"),
    "vmlck_after_end": ("after", "vmlck"),
    "threads_python_after_end": ("after", "threads_py"),
    "threads_os_after_end": ("after", "threads_os"),
}
PINNED_NOTE = (
    "pinned_nccl_suspended_bytes_during: NCCL's own count (ncclCommMemStats, suspendable "
    "bytes) of the groups this rank had suspended at the reading; ncclCommSuspend copies the "
    "offload part of them to cudaHostAlloc'd (pinned) host memory and frees it after the "
    "restore in ncclCommResume, so it is an upper bound of the pinned bytes held during the "
    "phase. vmlck/vmpin: the kernel's VmLck/VmPin of /proc/self/status (CUDA's pinned "
    "allocations are usually not counted there: 0 or flat is expected). host_rss_during - "
    "host_rss_after_end shows the pinned copies as resident memory. torch's host allocator "
    "stats do not see NCCL's allocations and are not read.")
GUARD_NOTE = (
    "guard: on cycles c % guard_every == 3 every rank issues an all-reduce on its group of a "
    "rotating suspended role during the phase; the guard resumes it and end() learns it. The "
    "next cycle checks that role is kept as 'learned' on every rank, then forget_learned() runs "
    "after that cycle's end; the cycle after suspends it again (checked).")
DISAGREE_NOTE = (
    "disagreement: on cycles c % disagree_every == disagree_every // 2 + 2, rank k = "
    "(c // disagree_every) % world runs that cycle on a second policy whose keep adds 'dp'; "
    "the others use the main one. Both policies exist on every rank and were set up together "
    "(one collective begin/end at start): a policy's first begin agrees on the backend with "
    "every rank, so one created on one rank alone for that cycle would wait for that round "
    "and come out inert. Policies of one process share agreement rounds "
    "(agreement.shared_rounds), so the two line up. Checked: 'dp' kept on every member of "
    "rank k's dp group (reason 'a peer rank refused' on the others), suspended elsewhere, "
    "no guard resume, exact.")


def layout(world: int, extra: int) -> dict:
    """role -> the rank lists of its groups (every rank is in one group per role)."""
    tp = 2 if world >= 4 and world % 2 == 0 else world
    blocks = [list(range(i, i + tp)) for i in range(0, world, tp)]
    strides = [list(range(i, world, tp)) for i in range(tp)]
    if len(strides[0]) < 2:  # 2 ranks: no room for TP x DP, every group spans both
        strides = [list(range(world))]
    roles = {"world": [list(range(world))]}
    roles.update({role: blocks for role in TP_LIKE})
    roles.update({role: strides for role in DP_LIKE})
    roles["tp_dp_cp"] = [list(range(world))]
    roles.update({f"dp_extra_{i}": [list(range(world))] for i in range(extra)})
    return roles


def flat(values: list, warmup_fraction: float = WARMUP_FRACTION,
         tolerance: float = FLAT_TOLERANCE) -> dict:
    """Warm-up: the first 10 % of the samples (at least one). Window: a tenth of
    the rest, at least 3 samples. Flat: the last window's median is within 1 %
    of the first post-warm-up window's median. Too few samples is not a pass."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"ok": None, "why": "not measured here"}
    warm = max(1, math.ceil(len(xs) * warmup_fraction))
    post = xs[warm:]
    window = max(3, len(post) // 10)
    if len(post) < 2 * window:
        return {"ok": False, "samples": len(xs),
                "why": f"{len(post)} samples after warm-up; {2 * window} needed to judge"}
    first, last = statistics.median(post[:window]), statistics.median(post[-window:])
    change = last - first
    relative = abs(change) / abs(first) if first else (0.0 if change == 0 else math.inf)
    return {"ok": relative <= tolerance, "first": first, "last": last, "change": change,
            "relative": relative, "min": min(post), "max": max(post), "samples": len(xs),
            "warmup_samples": warm, "window": window}


def proc_status() -> dict:
    """VmRSS, VmLck, VmPin in bytes and Threads from /proc/self/status."""
    from tests.gpu.common import proc_fields

    return proc_fields("/proc/self/status", ("VmRSS", "VmLck", "VmPin", "Threads"))


# --- rank program ---------------------------------------------------------
class Soak:
    def __init__(self, cfg: dict):
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from amem_callbacks import name_group

        self.cfg, self.cpu, self.torch, self.dist = cfg, cfg["cpu"], torch, dist
        timeout = timedelta(seconds=cfg["c10d_timeout_s"])
        if self.cpu:
            self.device = "cpu"
            dist.init_process_group("gloo", timeout=timeout)
        else:
            from tests.gpu.common import bind_device

            bind_device()
            self.device = f"cuda:{torch.cuda.current_device()}"
            dist.init_process_group("nccl", timeout=timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sync = dist.new_group(backend="gloo", timeout=timeout)  # safe while NCCL sleeps
        self.layout = layout(self.world, cfg["extra"])
        self.groups, self.members = {}, {}  # role -> this rank's group, its ranks
        for role, lists in self.layout.items():
            for ranks in lists:  # every rank creates every group, in the same order
                group = dist.group.WORLD if role == "world" else dist.new_group(ranks,
                                                                                 timeout=timeout)
                if self.rank in ranks:
                    self.groups[role], self.members[role] = group, ranks
                    if role != "world":
                        name_group(group, role)
        self.suspendable = [role for role in self.groups if role not in KEEP]
        self.failures, self.failure_count = [], 0
        self.samples, self.cycle_s, self.begin_wall_s, self.end_wall_s = [], [], [], []
        self.counts = {"guard": 0, "learned": 0, "disagree": 0, "disagree_member": 0}
        self._fake = None

    # -- helpers
    def exact(self, group, value: float, wrong: bool = False) -> bool:
        """All-reduce value * (rank + 1) and check the exact sum (``wrong``:
        this rank adds 0.5, the injected failure of the CPU test)."""
        torch, dist = self.torch, self.dist
        t = torch.full((self.cfg["numel"],), value * (self.rank + 1) + (0.5 if wrong else 0.0),
                       device=self.device)
        dist.all_reduce(t, group=group)
        expected = value * sum(r + 1 for r in dist.get_process_group_ranks(group))
        return bool(torch.all(t == expected).item())

    def fail(self, cycle: int, what: str) -> None:
        self.failure_count += 1
        if len(self.failures) < 50:
            self.failures.append({"cycle": cycle, "what": what})
        print(f"soak: rank {self.rank} FAILURE cycle {cycle}: {what}", flush=True)

    def check(self, cycle: int, what: str, ok: bool) -> None:
        if not ok:
            self.fail(cycle, what)

    def guard_resumes(self) -> int:
        """The guard's resumes so far, both policies, from their public metrics."""
        return sum(p.metrics(last=False)["amem/total/auto_resumes"] for p in (self.main, self.alt))

    def barrier(self) -> None:
        self.dist.barrier(group=self.sync)

    def backend(self):
        if not self.cpu:
            return "nccl"
        if self._fake is None:
            from tests.scenarios import FakeNccl

            self._fake = FakeNccl(default_mib=self.cfg["fake_mib"])
        return self._fake.backend()

    def reading(self) -> dict:
        """Taken between two gloo barriers: every rank's transition has finished
        and nobody starts the next one while the others read."""
        from tests.gpu.common import STAND_IN_PROCESS_BYTES, process_device_bytes

        if not self.cpu:
            self.torch.cuda.synchronize()
        self.barrier()
        status = proc_status()
        row = {"device_free": None if self.cpu else self.torch.cuda.mem_get_info()[0],
               "rss": status.get("VmRSS"), "vmlck": status.get("VmLck"),
               "vmpin": status.get("VmPin"), "threads_os": status.get("Threads"),
               "threads_py": threading.active_count(),
               "device_process": STAND_IN_PROCESS_BYTES if self.cpu else process_device_bytes()}
        self.barrier()
        return row

    # -- the soak
    def run(self) -> dict:
        from amem_callbacks import OffloadPolicy

        cfg = self.cfg
        for group in self.groups.values():  # create every communicator
            assert self.exact(group, 1.0)
        options = dict(keep=KEEP, learn_keep=True, overlap=True, workers=cfg["workers"],
                       min_bytes=0, timeout_s=cfg["timeout_s"],
                       agree_timeout_s=cfg["agree_timeout_s"],
                       groups=list(self.groups.values()))
        if not self.cpu:
            options["device"] = self.torch.cuda.current_device()
        self.main = OffloadPolicy(backend=self.backend(), **options)
        self.alt = OffloadPolicy(backend=self.backend(), **{**options,
                                                            "keep": KEEP + [DISPUTED]})
        self.alt.begin("rollout")  # set-up of the second policy, on every rank together
        self.barrier()
        self.alt.end("rollout")
        self.alt.wait()
        assert all(self.exact(g, 2.0) for g in self.groups.values())
        setup_s = time.time() - cfg["started"]
        first = time.time()
        deadline = min(first + cfg["seconds"], cfg["stop_by"])
        cycle = 0
        while True:
            # rank 0 alone decides, so every rank stops after the same cycle
            stop = self.torch.tensor([int(self.rank == 0 and (
                time.time() >= deadline or cycle >= cfg["max_cycles"]))])
            self.dist.all_reduce(stop, group=self.sync, op=self.dist.ReduceOp.MAX)
            if stop.item():
                break
            cycle += 1
            self.cycle(cycle, first)
        cycling_s = time.time() - first
        self.main.close()
        self.alt.close()
        final = all(self.exact(g, 3.0) for g in self.groups.values())
        self.check(cycle, "final all-reduce on every group", final)
        return {"rank": self.rank, "ok": self.failure_count == 0 and cycle > 0,
                "cycles": cycle, "cycling_s": cycling_s, "setup_s": setup_s,
                "failure_count": self.failure_count, "failures": self.failures,
                "samples": self.samples, "cycle_s": self.cycle_s,
                "begin_wall_s": self.begin_wall_s, "end_wall_s": self.end_wall_s,
                "counts": self.counts, "groups": {r: self.members[r] for r in self.groups},
                "counters": {"main": self.main.metrics(last=False),
                             "alt": self.alt.metrics(last=False)},
                "versions": self.versions()}

    def cycle(self, c: int, first: float) -> None:
        from amem_callbacks.states import Outcome

        cfg = self.cfg
        g_every, d_every = cfg["guard_every"], cfg["disagree_every"]
        guard, learned = c % g_every == 3, c % g_every == 4
        disagree = c % d_every == d_every // 2 + 2 and not (guard or learned)
        k = (c // d_every) % self.world
        sample = c % cfg["sample_every"] == 0 and not (guard or learned or disagree)
        guard_role = self.suspendable[(c // g_every) % len(self.suspendable)]
        policy = self.alt if disagree and self.rank == k else self.main
        expected = set(self.suspendable)
        kept_because = {}  # role -> words its kept reason must hold
        if learned:
            expected.discard(guard_role)
            kept_because[guard_role] = "learned:"
            self.counts["learned"] += 1
        if disagree:
            self.counts["disagree"] += 1
            if k in self.members[DISPUTED]:
                self.counts["disagree_member"] += 1
                expected.discard(DISPUTED)
                kept_because[DISPUTED] = ("kept active for phase" if self.rank == k
                                          else "a peer rank refused")
        value = float(c % 7 + 1)
        resumes_before = self.guard_resumes()
        start = time.monotonic()

        begin = policy.begin("rollout")
        during = None
        if sample:
            policy.wait()
            during = self.reading()
            during["suspended_bytes"] = sum(g.suspendable_bytes or 0 for g in begin.suspended)
        for role in KEEP + sorted(kept_because):  # groups that stay active must work
            self.check(c, f"during/{role} exact", self.exact(self.groups[role], value))
        if guard:
            self.counts["guard"] += 1
            self.check(c, f"guard/{guard_role} exact", self.exact(self.groups[guard_role],
                                                                   value + 1))
        if cfg["inject_hang_at"] == c and self.rank == self.world - 1:
            time.sleep(10**6)  # test of this script: a rank that never comes back
        self.barrier()  # the rollout ends on every rank: over gloo only
        end = policy.end("rollout")
        wrong = cfg["inject_wrong_at"] == c and self.rank == self.world - 1
        for i, (role, group) in enumerate(self.groups.items()):
            self.check(c, f"after/{role} exact", self.exact(group, value + 2, wrong and i == 0))
        policy.wait()
        if learned:
            self.main.forget_learned()
        self.cycle_s.append(round(time.monotonic() - start, 4))
        self.begin_wall_s.append(round(begin.wall_seconds, 4))
        self.end_wall_s.append(round(end.wall_seconds, 4))

        suspended = {g.name for g in begin.suspended}
        self.check(c, f"suspended {sorted(suspended)} != expected {sorted(expected)}",
                   suspended == expected)
        resumed = {g.name for g in end.groups if g.action == Outcome.RESUMED}
        self.check(c, f"resumed {sorted(resumed)} != suspended {sorted(expected)}",
                   resumed == expected)
        failed = [(g.name, g.error or g.reason) for g in begin.failed + end.failed]
        self.check(c, f"failed groups {failed}", not failed)
        late = [g.name for g in begin.kept if "did not" in g.reason]  # agreement timeouts
        self.check(c, f"agreement timed out on {late}", not late)
        reasons = {g.name: g.reason for g in begin.kept}
        for role, words in kept_because.items():
            self.check(c, f"{role} kept because {words!r}, got {reasons.get(role)!r}",
                       words in reasons.get(role, ""))
        resumes = self.guard_resumes()
        self.check(c, f"guard resumes {resumes - resumes_before}, expected {int(guard)}",
                   resumes - resumes_before == int(guard))
        if guard:
            why = {g.name: g.reason for g in end.groups}.get(guard_role, "")
            self.check(c, f"{guard_role} not resumed by the guard: {why!r}",
                       "resumed by the guard" in why)
        if sample:
            after = self.reading()
            self.samples.append({"cycle": c, "t": round(time.time() - first, 2),
                                 "during": during, "after": after})
        if self.rank == 0 and c % cfg["progress_every"] == 0:
            rate = c / max(1e-9, time.time() - first)
            last = self.samples[-1]["after"] if self.samples else {}
            free = last.get("device_free")
            print(f"soak: cycle {c} t={time.time() - first:.0f}s {rate:.2f} cycles/s "
                  f"free_after_end={'-' if free is None else f'{free / 2**20:.0f} MiB'} "
                  f"rss={last.get('rss', 0) / 2**20:.0f} MiB threads={last.get('threads_os')} "
                  f"failures={self.failure_count}", flush=True)

    def versions(self) -> dict:
        import platform

        import amem_callbacks
        from amem_callbacks.nccl_library import NcclLibrary

        out = {"torch": self.torch.__version__, "torch_cuda": self.torch.version.cuda,
               "python": platform.python_version(), "amem_callbacks": amem_callbacks.__version__}
        lib = self._fake.library if self._fake else NcclLibrary.loaded()
        out["nccl_loaded"] = f"{lib.version_str} ({lib.path})" if lib else None
        if not self.cpu:
            out["gpu"] = self.torch.cuda.get_device_name()
            out["gpus_visible"] = self.torch.cuda.device_count()
        return out


def rank_main(cfg: dict) -> None:
    sys.path.insert(0, ROOT)
    import faulthandler

    faulthandler.dump_traceback_later(max(10, cfg["wall"] - 15))  # a hang leaves its stacks
    rank = int(os.environ["RANK"])
    try:
        soak = Soak(cfg)
        result = soak.run()
    except Exception as exc:  # recorded; the driver stops the others
        import traceback

        result = {"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
        soak = None
    with open(os.path.join(cfg["work"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    if soak is not None:
        try:
            soak.barrier()  # every result written before any process leaves
        except Exception:
            pass
    sys.stdout.flush()
    os._exit(0 if result.get("ok") else 1)


# --- driver ---------------------------------------------------------------
def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="result JSON (the PNG goes beside it)")
    p.add_argument("--seconds", type=float, default=480.0,
                   help="cycling budget, from the first cycle (default 480)")
    p.add_argument("--wall", type=float, default=None,
                   help="hard limit of the whole run, start-up included; past it every rank "
                        "is killed and the run fails as a hang (default: --seconds + 90)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--extra", type=int, default=6, help="extra DP-like groups over all ranks")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--sample-every", type=int, default=10)
    p.add_argument("--guard-every", type=int, default=10)
    p.add_argument("--disagree-every", type=int, default=50)
    p.add_argument("--cycles", type=int, default=10**9, help="stop after this many cycles")
    p.add_argument("--min-cycles", type=int, default=1, help="fewer cycles fail the run")
    p.add_argument("--timeout-s", type=float, default=120.0, help="the policy's timeout_s")
    p.add_argument("--agree-timeout-s", type=float, default=60.0)
    p.add_argument("--inject-wrong-at", type=int, default=0,
                   help="test of this script: the last rank adds 0.5 to one all-reduce of "
                        "this cycle, which must turn the verdict red")
    p.add_argument("--inject-hang-at", type=int, default=0,
                   help="test of this script: the last rank stops at this cycle's barrier "
                        "for good, which the wall limit must turn into a failure")
    p.add_argument("--cpu", action="store_true",
                   help="gloo ranks and the fake NCCL (also AMEM_GPU_DRIVER_ON_CPU=1 or "
                        "AMEM_SOAK_CPU=1)")
    p.add_argument("--shared-gpu", action="store_true",
                   help="other jobs use this GPU too: the whole-GPU free memory "
                        "(device_free_*) is recorded but not judged; this process's own "
                        "device bytes (NVML, device_process_*) are")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from tests.gpu.common import ON_CPU

    args.cpu = args.cpu or ON_CPU
    args.wall = args.wall or args.seconds + 90
    if args.guard_every < 5:
        p.error("--guard-every must be >= 5 (guard, learned-check and plain cycles)")
    return args


def _pump(proc, log_path: str) -> None:
    """A rank's output to its log; its 'soak:' lines also to ours (progress)."""
    with open(log_path, "w") as log:
        for line in proc.stdout:
            log.write(line)
            if line.startswith("soak:"):
                print(line, end="", flush=True)


def launch(args, work: str, started: float) -> tuple:
    cfg = {"cpu": args.cpu, "seconds": args.seconds, "wall": args.wall, "started": started,
           # stop cycling early enough to leave time for the teardown within --wall
           "stop_by": started + args.wall - min(45.0, 0.25 * args.wall),
           "max_cycles": args.cycles, "extra": args.extra, "workers": args.workers,
           "sample_every": args.sample_every, "guard_every": args.guard_every,
           "disagree_every": args.disagree_every, "inject_wrong_at": args.inject_wrong_at,
           "inject_hang_at": args.inject_hang_at,
           "timeout_s": args.timeout_s, "agree_timeout_s": args.agree_timeout_s,
           "c10d_timeout_s": max(60.0, args.timeout_s), "numel": 64 if args.cpu else 1 << 18,
           "fake_mib": 32, "work": work, "progress_every": 10 if args.cpu else 50}
    from amem_callbacks.tools.launch import free_port
    port = free_port()
    base = dict(os.environ, WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), PYTHONPATH=ROOT + os.pathsep + os.environ.get(
                    "PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    if not args.cpu:
        for key, value in NCCL_ENV.items():
            base.setdefault(key, value)
    else:  # build the fake NCCL once, not once per rank
        from tests.fake_nccl import build

        base["AMEM_FAKE_NCCL_DIR"] = os.path.dirname(build("suspend", work))
    procs, pumps = [], []
    for rank in range(args.ranks):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank",
                                 json.dumps(cfg)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        pump = threading.Thread(target=_pump, args=(proc, os.path.join(work, f"rank{rank}.log")),
                                daemon=True)
        pump.start()
        procs.append(proc)
        pumps.append(pump)
    return procs, pumps, {k: base.get(k) for k in sorted(base) if k.startswith("NCCL_")}


def wait_all(procs, deadline: float, grace_s: float) -> dict:
    """Until every rank exits, or the wall limit, or ``grace_s`` after a rank
    failed (the others then wait in a collective for it): kill what is left."""
    failed_at, why = None, None
    while any(p.poll() is None for p in procs):
        now = time.time()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now >= deadline:
            why = "hung past the wall limit"
        elif failed_at is not None and now >= failed_at + grace_s:
            why = f"killed {grace_s:g} s after another rank failed"
        if why:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    return {"killed": why, "exit_codes": [p.returncode for p in procs]}


def summarize(args, ranks: list, ended: dict, env: dict, started: float) -> dict:
    from tests.gpu.common import run_commit

    done = [r for r in ranks if r is not None]
    series, verdicts = {"cycle": {}}, {}
    for r in done:
        series["cycle"][r["rank"]] = [s["cycle"] for s in r.get("samples", [])]
    for name, (point, key) in SERIES.items():
        series[name], verdicts[name] = {}, {}
        for r in done:
            values = [s[point].get(key) for s in r.get("samples", [])]
            series[name][r["rank"]] = values
            verdicts[name][r["rank"]] = flat(values)
            if args.shared_gpu and name.startswith("device_free"):
                verdicts[name][r["rank"]] = {**verdicts[name][r["rank"]], "ok": None,
                                             "why": SHARED_GPU_WHY}
    cycles = sorted({r.get("cycles") for r in done})
    cycle_s = [x for r in done for x in r.get("cycle_s", [])]
    no_hang = ended["killed"] is None
    no_failure = len(done) == args.ranks and all(r.get("ok") and not r.get("failure_count")
                                                 for r in done)
    all_flat = all(v["ok"] is not False for per_rank in verdicts.values()
                   for v in per_rank.values())
    enough = len(cycles) == 1 and cycles[0] is not None and cycles[0] >= args.min_cycles
    rank0 = next((r for r in done if r["rank"] == 0), {})
    env_prefix = " ".join([f"LD_PRELOAD={shlex.quote(os.environ['LD_PRELOAD'])}"]
                          if os.environ.get("LD_PRELOAD") else []) + " PYTHONPATH=$PWD"
    for name in ("AMEM_GPU_DRIVER_ON_CPU", "AMEM_SOAK_CPU"):  # the CPU mode, if it came so
        if os.environ.get(name) == "1":
            env_prefix += f" {name}=1"
    return {
        "ok": no_hang and no_failure and all_flat and enough,
        "verdict": {"no_hang": no_hang, "no_failure": no_failure, "flat": all_flat,
                    "same_cycle_count_on_every_rank": len(cycles) == 1,
                    "cycles_at_least_min": enough, "goal_1000_cycles_met":
                        bool(cycles) and (cycles[0] or 0) >= 1000},
        "command": f"{env_prefix.strip()} {os.path.basename(sys.executable)} tests/gpu/soak_gpu.py "
                   + " ".join(map(shlex.quote, args.argv)),
        "commit": run_commit(),
        "mode": "cpu-fake-nccl" if args.cpu else "gpu",
        "versions": rank0.get("versions"), "nccl_env": env,
        "ranks": args.ranks, "layout": layout(args.ranks, args.extra),
        "groups_per_rank": len(layout(args.ranks, args.extra)), "kept_roles": KEEP,
        "options": {"keep": KEEP, "learn_keep": True, "overlap": True, "workers": args.workers,
                    "min_bytes": 0, "timeout_s": args.timeout_s,
                    "agree_timeout_s": args.agree_timeout_s},
        "schedule": {"sample_every": args.sample_every, "guard_every": args.guard_every,
                     "disagree_every": args.disagree_every, "samples_skip_special_cycles": True},
        "guard_strategy": GUARD_NOTE, "disagreement_strategy": DISAGREE_NOTE,
        "pinned_host_memory_figure": PINNED_NOTE,
        "readings": "every sample_every-th cycle, on every rank between two gloo barriers: "
                    "'during' after begin had finished (policy.wait()), 'after' after end, the "
                    "exact all-reduces and policy.wait(). device_free is cudaMemGetInfo of the "
                    "rank's GPU (the whole GPU's when ranks share it); device_process is NVML's "
                    "count of this process's own device bytes (context, allocator, NCCL).",
        "shared_gpu": args.shared_gpu,
        "flat_rule": f"warm-up: the first {WARMUP_FRACTION:.0%} of the samples (at least 1); "
                     "window: a tenth of the rest, at least 3; flat: |median(last window) - "
                     f"median(first window)| <= {FLAT_TOLERANCE:.0%} of the first",
        "cycles": cycles[0] if len(cycles) == 1 else cycles,
        "cycling_seconds": rank0.get("cycling_s"), "setup_seconds": rank0.get("setup_s"),
        "run_seconds": round(time.time() - started, 1), "wall_limit_s": args.wall,
        "cycles_per_second": (rank0["cycles"] / rank0["cycling_s"]
                              if rank0.get("cycling_s") else None),
        "cycle_seconds": _stats(cycle_s), "cycle_seconds_rank0": rank0.get("cycle_s"),
        "begin_wall_seconds": _stats([x for r in done for x in r.get("begin_wall_s", [])]),
        "end_wall_seconds": _stats([x for r in done for x in r.get("end_wall_s", [])]),
        "special_cycles": {r["rank"]: r.get("counts") for r in done},
        "killed": ended["killed"], "exit_codes": ended["exit_codes"],
        "failures": {r["rank"]: r.get("failures") or r.get("error") for r in done
                     if r.get("failures") or r.get("error")},
        "missing_results": [i for i, r in enumerate(ranks) if r is None],
        "flat": verdicts, "series": series,
        "first_sample": {r["rank"]: (r.get("samples") or [None])[0] for r in done},
        "counters": {r["rank"]: r.get("counters") for r in done},
    }


def _stats(xs: list) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))],
            "max": xs[-1]}


def main(argv=None) -> int:
    sys.path.insert(0, ROOT)  # tests.* from any working directory
    args = parse(argv)
    started = time.time()
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    work = os.path.splitext(out)[0] + "_ranks"  # rank logs and results, kept beside the JSON
    os.makedirs(work, exist_ok=True)
    for name in os.listdir(work):  # an earlier run's results must not stand in for this one's
        if name.startswith("rank"):
            os.remove(os.path.join(work, name))
    print(f"soak: {args.ranks} ranks, {'CPU (fake NCCL)' if args.cpu else 'GPU'}, "
          f"{args.seconds:g} s of cycles, wall limit {args.wall:g} s; rank logs in {work}",
          flush=True)
    procs, pumps, env = launch(args, work, started)
    ended = wait_all(procs, started + args.wall, grace_s=10.0 if args.cpu else 30.0)
    for pump in pumps:
        pump.join(5)
    ranks = []
    for rank in range(args.ranks):
        path = os.path.join(work, f"rank{rank}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else None)
    result = summarize(args, ranks, ended, env, started)
    result["rank_logs"] = work
    if not result["ok"]:
        result["log_tails"] = {rank: open(os.path.join(work, f"rank{rank}.log"),
                                          errors="replace").read()[-3000:]
                               for rank in range(args.ranks)}
    png = os.path.splitext(out)[0] + ".png"
    result["plot"] = "not drawn (--no-plot)"
    if not args.no_plot:
        from tests.gpu.plot_soak import plot

        result["plot"] = plot(result, png)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    bad = {name: {rank: v for rank, v in per.items() if v["ok"] is False}
           for name, per in result["flat"].items()}
    print(f"soak: {'PASS' if result['ok'] else 'FAIL'} {result['cycles']} cycles in "
          f"{result['cycling_seconds'] or 0:.0f} s; verdict {result['verdict']}; "
          f"not flat: {({n: list(b) for n, b in bad.items() if b}) or 'none'}; "
          f"killed: {result['killed']}; plot: {result['plot']}; JSON: {out}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank":
        rank_main(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
