"""Reliability on real NCCL, 2 ranks: faults, bad set-ups and long runs.

Command (2 GPUs; NCCL >= 2.29.7 preloaded, e.g. the output of ../shared/tools/device-nccl):
    LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONPATH=$PWD python3 tests/gpu/reliability_gpu.py OUT.json

This file is both the driver and the rank program. The driver starts two rank
processes per case (its own launcher, so that each case can change the
environment NCCL sees, e.g. drop the preload or set NCCL_CUMEM_ENABLE=0),
bounds every case by a wall-clock limit (a hang is a failure, not a stuck job),
and writes one JSON table: case, what must hold, pass/fail, seconds, details.

Ranks synchronise over a gloo group while NCCL groups are suspended: a
collective on a suspended NCCL communicator is an illegal memory access.

``AMEM_RELIABILITY_CPU=1`` runs the cases that do not need a GPU on gloo with
the fake NCCL of tests/fake_nccl (a check of this script, not a GPU result).
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = os.environ.get("AMEM_RELIABILITY_CPU") == "1"
# AMEM_GPU_QUICK=1 (the one-GPU runner): fewer seeds and cycles. Two ranks on one
# GPU make each transition several times slower (shared device, pinned copies).
QUICK = os.environ.get("AMEM_GPU_QUICK") == "1"
MiB = 2**20

CASES = {}  # name -> (function, what must hold, wall limit s, environment changes)


def case(must_hold: str, limit_s: float, env: dict = None, gpu_only: bool = False):
    def register(fn):
        if not (gpu_only and CPU):
            CASES[fn.__name__] = (fn, must_hold, limit_s, env or {})
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
        self.sync = dist.new_group(backend="gloo")  # barriers while NCCL groups sleep
        self._fake = None

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
        if not CPU:
            return name
        if self._fake is None:
            from tests.scenarios import FakeNccl

            self._fake = FakeNccl(default_mib=64)
        return self._fake.backend()

    def free(self) -> int:
        if CPU:
            return 0
        from tests.gpu.common import free_bytes

        return free_bytes()

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
    from torch.distributed import distributed_c10d as c10d

    from amem_callbacks.states import Status
    from tests.random_program import run_random_program

    groups = r.groups("dp", "ep", "tp")
    current = {}
    violations = []
    original = c10d.all_reduce

    def spy(tensor, *args, **kwargs):
        policy = current.get("policy")
        group = kwargs.get("group")
        state = policy._engine._state_of(group) if policy and policy._engine and group else None
        if state is not None and state.status is not Status.ACTIVE:
            violations.append(state.info.name)
        return original(tensor, *args, **kwargs)

    c10d.all_reduce = r.dist.all_reduce = spy  # the guard, installed later, wraps the spy
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
                         "auto_resumes": policy.counters.auto_resumes,
                         "suspends": policy.counters.group_suspends,
                         "failures": policy.counters.failures})
            r.barrier()
    finally:
        c10d.all_reduce = r.dist.all_reduce = original
    ok = not violations and all(run["exact"] and not run["failures"] for run in runs)
    return {"ok": ok and len(runs) == seeds, "violations": violations, "runs": runs,
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
    return {"ok": losses == base_losses and same_params and policy.counters.group_suspends > 0,
            "losses_equal": losses == base_losses, "params_equal": same_params,
            "losses": losses, "suspends": policy.counters.group_suspends}


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
            and policy.counters.group_suspends == n,
            "cycles": n, "warmup": warmup, "device_total": total,
            "device_free_after_end_spread": spread(after), "device_free_during_spread": spread(during),
            "freed_per_cycle_min_max": [min(freed[warmup:]), max(freed[warmup:])],
            "host_rss_spread": spread(rss), "host_rss_after_warmup": rss[warmup],
            "host_rss_last": rss[-1], "threads_spread": spread(threads), "exact": exact,
            "suspends": policy.counters.group_suspends}


def _unusable(r: Rank, backend: str, words: list, backend_options=None) -> dict:
    """One policy that cannot work here: one WARNING line with the reason and
    the fix, nothing suspended, the same memory, exact results."""
    groups = r.groups("dp", "tp")
    lines = WarningLines()
    policy = r.policy(backend=backend, backend_options=backend_options)
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
    ok = (policy.inert and all(skipped) and exact and len(lines.lines) == 1
          and all(found.values()) and abs(moved) < 64 * MiB)
    return {"ok": ok, "inert": policy.inert, "lines": lines.lines, "words_found": found,
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
      env={"NCCL_CUMEM_ENABLE": "0"}, gpu_only=True)
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
      "no hang", 200)
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


# --- rank process --------------------------------------------------------
def rank_main(name: str, out_dir: str) -> None:
    sys.path.insert(0, ROOT)
    fn, _must, limit_s, _env = CASES[name]
    import faulthandler

    faulthandler.dump_traceback_later(max(5, limit_s - 20))  # a hang leaves every stack in the log
    r = Rank(c10d_timeout_s=30 if name == "rank_dies" else limit_s)
    try:
        result = fn(r)
    except Exception as exc:  # recorded, and the exit code says it failed
        import traceback

        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{r.rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    try:
        r.barrier()  # both results written before either process leaves
    except Exception:
        pass
    sys.stdout.flush()
    os._exit(0 if result.get("ok") is not False else 1)


# --- driver --------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(name: str) -> dict:
    _fn, must_hold, limit_s, env_changes = CASES[name]
    out_dir = tempfile.mkdtemp(prefix=f"amem-rel-{name}-")
    port = _free_port()
    procs, logs = [], []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_MULTI_RANK_GPU_ENABLE="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for key, value in env_changes.items():
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
    hung = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, limit_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            hung = True
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for log in logs:
        log.close()
    seconds = time.monotonic() - start
    ranks = []
    for rank in range(2):
        path = os.path.join(out_dir, f"rank{rank}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else None)
    tails = [open(os.path.join(out_dir, f"rank{k}.log")).read()[-3000:] for k in range(2)]
    considered = ranks[:1] if name == "rank_dies" else ranks  # rank 1 dies on purpose there
    verdicts = [None if res is None else res.get("ok") for res in considered]
    if hung:
        ok = False
    elif any(v is None for v in verdicts) and all(res is not None for res in considered):
        ok = None  # not applicable here
    else:
        ok = all(v is True for v in verdicts)
    row = {"case": name, "must_hold": must_hold, "ok": ok, "seconds": round(seconds, 1),
           "hung_past_limit_s": limit_s if hung else None,
           "exit_codes": [p.returncode for p in procs], "ranks": ranks}
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
            rows.append({"case": name, "must_hold": CASES[name][1], "ok": None, "seconds": 0,
                         "skipped": "torch's own NCCL (2.28.9) refuses two ranks on one GPU: "
                                    "this case needs two GPUs"})
            continue
        row = run_case(name)
        rows.append(row)
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[row["ok"]]
        print(f"{verdict:4}  {name:16} {row['seconds']:7.1f} s  {row['must_hold']}", flush=True)
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
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-case":
        rank_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(driver(sys.argv[1], sys.argv[2:]))
