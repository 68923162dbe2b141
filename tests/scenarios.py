"""Multi-rank scenarios on gloo, run by tests.harness in fresh processes.

Usage (done by the harness): ``python -m tests.scenarios NAME JSON_ARGS`` with
NAME a function here or ``package.module:function`` elsewhere, and
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and AMEM_TEST_OUT set.
Each scenario returns a JSON-able dict, written to AMEM_TEST_OUT/rank<r>.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from amem_callbacks import OffloadPolicy, name_group
from amem_callbacks.backends.nccl import NcclBackend
from amem_callbacks.errors import SuspendedGroupError
from amem_callbacks.nccl_library import NcclLibrary
from tests import mutations
from tests.fake_nccl import RESUME_OP, SUSPEND_OP, FakeControls, build, tripwire
from tests.random_program import run_random_program

SCENARIOS = {}
MiB = 2**20


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def rank() -> int:
    return dist.get_rank()


def init(timeout_s: float = 60):
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


class FakeNccl:
    """A fake NCCL communicator behind every gloo group of this process.

    Every group mapped here is also registered with the tripwire
    (tests/fake_nccl/tripwire.py): a collective that reaches the group's gloo
    backend while its fake communicator is suspended ends the process, as real
    NCCL would.
    """

    #: FakeNccl instances made in this process (the same count on every rank: a
    #: scenario makes them at the same points), naming each one's shared folder
    made = 0

    def __init__(self, variant: str = "suspend", sizes: dict = None, default_mib: int = 480,
                 peers: bool = False, backup: tuple = None):
        """``peers``: each group's suspends and resumes wait for all its members, as
        NCCL's do (tests/fake_nccl/fake_nccl.c, "Peers"), through a folder this job's
        ranks agree on over the default store. Off by default: with it, the scenarios
        that inject an error on one rank (``inject``) wait for a member that never comes,
        the package's repair of a one-rank failure (a resume on the ranks that
        suspended, a retried resume on the rank that failed) being a call only some
        members make; what real NCCL does there is not measured. ``backup``: with the
        "runtime" variant, ``(entries, entry_bytes)`` each communicator's suspends copy to
        pinned host blocks through the stand-in driver, as NCCL's do."""
        tripwire.install()  # idempotent; main() installs it first for every scenario
        self.variant = variant
        FakeNccl.made += 1
        self.peer_folder = _job_folder(f"fake-nccl-peers-{FakeNccl.made}") if peers else None
        self.path = build(variant, os.environ.get("AMEM_FAKE_NCCL_DIR"))
        self.controls = FakeControls(self.path)
        self.library = NcclLibrary.open(self.path)
        self.sizes = sizes or {}
        self.default_mib = default_mib
        self.backup = backup
        self.comms = {}  # group name (role or desc) -> fake comm

    def handle_of(self, group):
        from amem_callbacks.groups import _describe
        from torch.distributed import distributed_c10d as c10d

        name = _describe(group, c10d._get_default_group())[1]
        if name not in self.comms:
            size = self.sizes.get(name, self.default_mib)
            self.comms[name] = self.controls.create(int(size * MiB))
            if self.backup:
                self.controls.set_backup(self.comms[name], *self.backup)
            if self.peer_folder and dist.get_world_size(group) > 1:
                self.controls.set_peers(self.comms[name], os.path.join(self.peer_folder, name),
                                        dist.get_rank(group), dist.get_world_size(group))
        tripwire.register(group, self.controls, self.comms[name], name,
                          amem=self.variant == "amem")
        return self.comms[name], None

    def backend(self) -> NcclBackend:
        return NcclBackend(library=self.library, handle_of=self.handle_of)

    def suspended(self) -> dict:
        return {name: self.controls.suspended(c) for name, c in sorted(self.comms.items())}


def _job_folder(key: str) -> str:
    """A folder new to this job, the same on every rank: rank 0 makes it and says
    where over the default store (no collective: nothing on a group)."""
    import tempfile

    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    if rank() == 0:
        store.set(key, tempfile.mkdtemp(prefix="fake-nccl-peers-"))
    return store.get(key).decode()


def make_groups(world: int) -> dict:
    """world, dp (all ranks), tp (all ranks), pairs; the same calls on every rank."""
    groups = {"world": dist.group.WORLD}
    groups["dp"] = dist.new_group(list(range(world)), group_desc="dp")
    groups["tp"] = dist.new_group(list(range(world)))
    name_group(groups["tp"], "tp")
    groups["ep"] = dist.new_group(list(range(world)))
    name_group(groups["ep"], "ep")
    return groups


def fake_groups(sizes: dict = None, peers: bool = False):
    """A scenario's start: gloo ranks, the groups of :func:`make_groups` with their
    communicators made (one collective each), a fake NCCL behind them (``peers``: its
    suspends and resumes wait for the group's other members, as NCCL's do).
    Returns ``(groups, fake)``."""
    init()
    groups = make_groups(dist.get_world_size())
    for g in groups.values():
        allreduce_ok(g)
    return groups, FakeNccl(sizes=sizes, peers=peers)


def fake_job(sizes: dict = None, peers: bool = False):
    """:func:`fake_groups` and a policy keeping tp: ``(groups, fake, policy)``."""
    groups, fake = fake_groups(sizes, peers)
    policy = OffloadPolicy(backend=fake.backend(), keep=["tp"], agree_timeout_s=20,
                           timeout_s=30)
    return groups, fake, policy


def allreduce_ok(group, value: float = 1.0) -> bool:
    t = torch.full((16,), float(rank() + 1) * value)
    dist.all_reduce(t, group=group)
    expected = value * sum(r + 1 for r in dist.get_process_group_ranks(group))
    return bool(torch.all(t == expected))


def summarize(report) -> dict:
    return {
        "skipped": report.skipped,
        "groups": {g.name: [g.action, g.reason, g.error] for g in report.groups},
        "nccl_bytes": report.nccl_bytes,
        "agree_seconds": report.agree_seconds,
        "flat": report.as_dict(),
    }


# --- what a scenario reads of a policy: its public surface only (issue #31) -------------

def totals(policy) -> dict:
    """The policy's running totals and learned keeps, flat (``metrics(last=False)``:
    ``amem/total/...``, ``amem/learned/...``, ``amem/inert``, ``amem/pending``)."""
    return policy.metrics(last=False)


def total(policy, name: str):
    """One running total, ``amem/total/<name>`` (auto_resumes, failures, begins, ...)."""
    return policy.metrics(last=False)[f"amem/total/{name}"]


def is_inert(policy) -> bool:
    """Whether the ranks agreed nothing can be freed here (``amem/inert``)."""
    return bool(policy.metrics()["amem/inert"])


def learned(policy) -> dict:
    """The learned keeps as ``metrics()`` gives them: ``amem/learned/<phase>/<group>``
    -> guard resumes ({} when nothing was learned)."""
    return {k: v for k, v in policy.metrics(last=False).items()
            if k.startswith("amem/learned/")}


def phase_open(policy) -> bool:
    """Whether a phase is open on this rank, as a session over the policy shows it
    (``RolloutSession.active``; the policy itself shows no phase state)."""
    from amem_callbacks import RolloutSession

    return RolloutSession(policy).active


@scenario
def discovery(args):
    init()
    groups = make_groups(dist.get_world_size())
    from amem_callbacks.backends.noop import NoopBackend
    from amem_callbacks.groups import discover

    infos = discover(NoopBackend())
    return {"groups": [[i.key, i.name, list(i.ranks), sorted(i.aliases)] for i in infos],
            "ranks_of_tp": dist.get_process_group_ranks(groups["tp"])}


@scenario
def fake_cycle(args):
    """Plan, agree, suspend, keep, resume on fake NCCL; collectives exact throughout."""
    # suspends and resumes wait for every member, as NCCL's do
    groups, fake, policy = fake_job(sizes={"ep": 2}, peers=True)  # ep is under min_bytes
    cycles = []
    for cycle in range(args.get("cycles", 3)):
        begin = policy.begin("rollout")
        during = fake.suspended()
        kept_ok = allreduce_ok(groups["tp"])  # the kept group works during the phase
        end = policy.end("rollout")
        after = fake.suspended()
        exact = all(allreduce_ok(g, cycle + 2) for g in groups.values())
        cycles.append({"begin": summarize(begin), "end": summarize(end), "during": during,
                       "after": after, "kept_ok": kept_ok, "exact": exact})
    return {"cycles": cycles, "counters": totals(policy),
            "metrics": policy.metrics(),
            "counts": {n: [fake.controls.count(c, SUSPEND_OP), fake.controls.count(c, RESUME_OP)]
                       for n, c in fake.comms.items()}}


@scenario
def guard(args):
    """A call on a suspended group resumes it first (resume) or raises (strict)."""
    init()
    world = dist.get_world_size()
    groups = make_groups(world)
    pair = dist.new_group([0, 1], group_desc="pair")
    for g in list(groups.values()) + [pair]:
        allreduce_ok(g)
    fake = FakeNccl()
    mode = args.get("mode", "resume")
    policy = OffloadPolicy(backend=fake.backend(), guard=mode, agree_timeout_s=20, timeout_s=30)
    out = {}
    policy.begin("rollout")
    out["suspended_before"] = fake.suspended()
    try:
        out["dp_exact"] = allreduce_ok(groups["dp"], 3.0)
        out["dp_suspended_after_call"] = fake.suspended()["dp"]
    except SuspendedGroupError as exc:
        out["dp_error"] = str(exc)
    # point-to-point on a 2-rank group: both ranks call -> resuming is safe
    if rank() < 2:
        t = torch.full((4,), float(rank()))
        try:
            if rank() == 0:
                dist.send(t + 7, dst=1, group=pair)
            else:
                dist.recv(t, src=0, group=pair)
                out["p2p_value"] = t.tolist()
        except SuspendedGroupError as exc:
            out["p2p_error"] = str(exc)
    if world > 2 and rank() < 2:
        t = torch.zeros(4)
        try:
            if rank() == 0:
                dist.send(t, dst=1, group=groups["ep"])
            else:
                dist.recv(t, src=0, group=groups["ep"])
        except SuspendedGroupError as exc:
            out["p2p_big_group_error"] = str(exc)
    # barrier on the world group goes through the guard too
    try:
        dist.barrier()
        out["barrier_ok"] = True
    except SuspendedGroupError as exc:
        out["barrier_error"] = str(exc)
    end = policy.end("rollout")
    out["end"] = summarize(end)
    out["after"] = fake.suspended()
    out["auto_resumes"] = total(policy, "auto_resumes")
    out["exact_after"] = all(allreduce_ok(g, 5.0) for g in groups.values())
    return out


@scenario
def disagree(args):
    """Ranks disagree (keep sets, a group missing on one rank): kept, bounded, no hang."""
    init()
    world = dist.get_world_size()
    groups = make_groups(world)
    for g in groups.values():
        allreduce_ok(g)
    fake = FakeNccl()
    keep = ["tp"] if rank() == 0 else ["ep"]
    only = None
    if args.get("missing_group") and rank() == 1:
        only = [g for n, g in groups.items() if n != "dp"]
    policy = OffloadPolicy(backend=fake.backend(), keep=keep, groups=only,
                           agree_timeout_s=args.get("agree_timeout_s", 3), timeout_s=30)
    start = time.monotonic()
    begin = policy.begin("rollout")
    took = time.monotonic() - start
    during = fake.suspended()
    exact_during = allreduce_ok(groups["tp"]) and allreduce_ok(groups["ep"])
    end = policy.end("rollout")
    return {"begin": summarize(begin), "during": during, "took": took,
            "exact_during": exact_during, "end": summarize(end),
            "exact_after": all(allreduce_ok(g) for g in groups.values())}


@scenario
def late_rank(args):
    """One rank reaches begin() long after the agreement timeout: the group stays
    active on all ranks, nobody blocks past the bound, and the next cycle works."""
    init()
    groups = make_groups(dist.get_world_size())
    for g in groups.values():
        allreduce_ok(g)
    fake = FakeNccl()
    timeout = args.get("agree_timeout_s", 2)
    policy = OffloadPolicy(backend=fake.backend(), agree_timeout_s=timeout, timeout_s=30)
    policy.begin("setup-check")  # every rank does the backend agreement together
    policy.end("setup-check")
    if rank() == 1:
        time.sleep(timeout * 2 + 1)
    start = time.monotonic()
    begin = policy.begin("rollout")
    took = time.monotonic() - start
    during = fake.suspended()
    policy.end("rollout")
    dist.barrier()
    second = policy.begin("rollout")
    during2 = fake.suspended()
    policy.end("rollout")
    return {"begin": summarize(begin), "took": took, "during": during,
            "second": summarize(second), "during2": during2,
            "exact": all(allreduce_ok(g) for g in groups.values())}


def _collectives(groups: dict) -> dict:
    """Each group's allreduce: exact (True/False), or the guard's error."""
    out = {}
    for name, g in groups.items():
        try:
            out[name] = allreduce_ok(g)
        except SuspendedGroupError as exc:
            out[name] = str(exc)
    return out


@scenario
def inject(args):
    """An NCCL error on one group of some ranks (``on_ranks``, default rank 0), where
    NCCL's own come (fake_nccl.c); ``peers``: its suspends and resumes wait for every
    member, as NCCL's do. Then every group's collective, and one more cycle."""
    init()
    groups = make_groups(dist.get_world_size())
    for g in groups.values():
        allreduce_ok(g)
    fake = FakeNccl(peers=args.get("peers", False))
    policy = OffloadPolicy(backend=fake.backend(), agree_timeout_s=20, timeout_s=30)
    for g in groups.values():  # create the fake comms before injecting
        fake.handle_of(g)
    op = SUSPEND_OP if args["op"] == "suspend" else RESUME_OP
    comm = fake.comms[args.get("group", "dp")]
    if rank() in args.get("on_ranks", [0]):
        fake.controls.inject(comm, op, args.get("code", 1), times=args.get("times", 1))
    started = time.monotonic()
    begin = policy.begin("rollout")
    during = fake.suspended()
    end = policy.end("rollout")
    out = {"begin": summarize(begin), "during": during, "end": summarize(end),
           "after": fake.suspended(), "partial": fake.controls.partial(comm),
           "resumes": fake.controls.count(comm, RESUME_OP),
           "peer_timed_out": fake.controls.peer_timed_out(comm),
           "failures": total(policy, "failures"), "took": time.monotonic() - started}
    out["collectives"] = _collectives(groups)
    out["exact_after"] = all(v is True for v in out["collectives"].values())
    # one more cycle: ranks are still in step; a broken group is not planned again
    second = policy.begin("rollout")
    out["second"] = summarize(second)
    policy.end("rollout")
    out["collectives_second"] = _collectives(groups)
    out["exact_second"] = all(v is True for v in out["collectives_second"].values())
    return out


@scenario
def backend_mismatch(args):
    """Rank 0 could suspend, rank 1 has no usable backend: all ranks run unchanged."""
    init()
    groups = make_groups(dist.get_world_size())
    fake = FakeNccl("suspend" if rank() == 0 else "old")
    policy = OffloadPolicy(backend=fake.backend(), agree_timeout_s=20)
    begin = policy.begin("rollout")
    during = fake.suspended()
    policy.end("rollout")
    return {"begin": summarize(begin), "inert": is_inert(policy), "during": during,
            "why": begin.skipped,  # an inert policy's begin says why it did nothing
            "exact": all(allreduce_ok(g) for g in groups.values())}


@scenario
def noop_dry_run(args):
    init()
    groups = make_groups(dist.get_world_size())
    policy = OffloadPolicy(backend="noop", keep=["tp"], agree_timeout_s=20)
    begin = policy.begin("rollout")
    exact = allreduce_ok(groups["dp"])  # guard "resumes" (dry) and counts it
    end = policy.end("rollout")
    return {"begin": summarize(begin), "end": summarize(end), "exact": exact,
            "auto_resumes": total(policy, "auto_resumes")}


@scenario
def amem_fake(args):
    """Process-wide backend: refuses when groups must stay active, else pauses once."""
    init()
    groups = make_groups(dist.get_world_size())
    from amem_callbacks.backends.amem import AmemBackend

    pair = dist.new_group([0, 1])
    fake = FakeNccl("amem")
    os.environ.update(NCCL_CUMEM_ENABLE="1", AMEM_ENABLE="1")
    backend = AmemBackend(library=fake.library, handle_of=fake.handle_of)
    policy = OffloadPolicy(backend=backend, keep=args.get("keep", []), agree_timeout_s=20)
    import ctypes

    paused = fake.controls.lib.fakeAmemPaused
    begin = policy.begin("rollout")
    during = paused()
    out = {"begin": summarize(begin), "paused_during": during}
    if args.get("keep"):
        out["tp_ok"] = allreduce_ok(groups["tp"])
    else:
        if rank() < 2:
            try:
                allreduce_ok(pair)
            except SuspendedGroupError as exc:
                out["subgroup_error"] = str(exc)
        out["world_sized_ok"] = allreduce_ok(groups["tp"])  # every rank calls: resumes
        out["paused_after_guard"] = paused()
    end = policy.end("rollout")
    out.update(end=summarize(end), paused_after=paused(),
               pauses=fake.controls.lib.fakeAmemCount(ctypes.c_int(0)),
               exact=all(allreduce_ok(g) for g in groups.values()))
    return out


@scenario
def lifecycle(args):
    """begin twice, end without begin, end naming another phase, context manager."""
    init()
    groups = make_groups(dist.get_world_size())
    for g in groups.values():
        allreduce_ok(g)
    fake = FakeNccl()
    policy = OffloadPolicy(backend=fake.backend(), agree_timeout_s=20)
    out = {"end_without_begin": policy.end("rollout").skipped}
    policy.begin("rollout")
    out["second_begin"] = policy.begin("rollout").skipped
    try:
        policy.end("eval")
    except ValueError as exc:
        out["wrong_end"] = str(exc)
    out["during"] = fake.suspended()
    policy.end("rollout")
    out["after"] = fake.suspended()
    with policy.phase("rollout") as rep:
        out["ctx_during"] = fake.suspended()
        out["ctx_begin"] = summarize(rep)
    out["ctx_after"] = fake.suspended()
    try:
        with policy.phase("rollout"):
            raise KeyError("boom")
    except KeyError:
        pass
    out["after_exception_open"] = phase_open(policy)
    out["after_exception"] = fake.suspended()
    out["exact"] = all(allreduce_ok(g) for g in groups.values())  # guard resumes
    out["auto_resumes"] = total(policy, "auto_resumes")
    out["after_guard"] = fake.suspended()
    return out


@scenario
def device_mesh(args):
    """DeviceMesh groups are found and named by their dimension."""
    init()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    fake = FakeNccl()
    policy = OffloadPolicy(backend=fake.backend(), keep=["tp"], agree_timeout_s=20)
    begin = policy.begin("rollout")
    tp_ok = allreduce_ok(mesh.get_group("tp"))
    policy.end("rollout")
    return {"begin": summarize(begin), "tp_ok": tp_ok,
            "dp_ranks": dist.get_process_group_ranks(mesh.get_group("dp"))}


def ready_groups() -> dict:
    """gloo, the test's groups, each used once (so each has its connections)."""
    init()
    groups = make_groups(dist.get_world_size())
    for g in groups.values():
        allreduce_ok(g)
    return groups


@scenario
def interleave(args):
    """Random interleavings of begin/end and calls on suspended, kept and
    transitioning groups, with slow fake transitions and overlap on: no call may
    ever reach a suspended communicator, and every result is exact."""
    import random

    groups = ready_groups()
    fake = FakeNccl()
    for g in groups.values():
        fake.controls.delay(fake.handle_of(g)[0], args.get("delay_us", 30000))
    # No spy needed: the fake NCCL's tripwire sits beneath the guard, on every
    # c10d op, and ends this rank (exit 86, tests.harness names the call) if
    # any collective reaches a suspended communicator. A rank that gets to the
    # return below had none.
    violations = []
    policy = OffloadPolicy(backend=fake.backend(), keep=["tp"], overlap=args.get("overlap", True),
                           workers=args.get("workers", 1), agree_timeout_s=30, timeout_s=60)
    same = random.Random(args.get("seed", 0))  # identical on every rank: same call order
    mine = random.Random(1000 + rank())  # per-rank timing noise
    actions, exact = run_random_program(policy, groups, allreduce_ok, same, mine,
                                        args.get("actions", 40), max_sleep_s=0.02)
    policy.end()
    policy.wait()
    exact.append(all(allreduce_ok(g) for g in groups.values()))
    return {"violations": violations, "exact": all(exact), "actions": actions,
            "auto_resumes": total(policy, "auto_resumes"), "left_suspended": fake.suspended(),
            "failures": total(policy, "failures")}


@scenario
def policies_in_sequence(args):
    """Several policies one after another in one job, the last with a keep-set
    only rank 0 has: each must agree afresh (no stale decision of an earlier
    policy), so the disputed group stays active on both ranks."""
    init()
    groups = make_groups(dist.get_world_size())
    for g in groups.values():
        allreduce_ok(g)
    fake = FakeNccl()
    rows = []
    for i in range(3):
        keep = ["tp", "dp"] if (i == 2 and rank() == 0) else ["tp"]
        policy = OffloadPolicy(backend=fake.backend(), keep=keep, agree_timeout_s=10,
                               timeout_s=20)
        begin = policy.begin("rollout")
        rows.append({g.name: g.action for g in begin.groups})
        policy.end("rollout")
        rows[-1]["exact"] = all(allreduce_ok(g) for g in groups.values())
    return {"rows": rows}


@scenario
def learn_keep(args):
    """Rollout calls a collective on "dp" (not in keep=) in the first phases;
    what each phase's plan did with dp, per rank. args: learn (per rank),
    guard, phases, touch_phases (which phases touch dp), forget_after."""
    init()
    groups = make_groups(dist.get_world_size())
    for g in groups.values():
        allreduce_ok(g)
    fake = FakeNccl()
    learn = args.get("learn", [True, True])[rank()]
    policy = OffloadPolicy(backend=fake.backend(), keep=args.get("keep", ["tp"]), learn_keep=learn,
                           guard=args.get("guard", "resume"), agree_timeout_s=20, timeout_s=30)
    phases = []
    for phase in range(args.get("phases", 3)):
        if phase == args.get("forget_after"):
            policy.forget_learned()
        begin = policy.begin("rollout")
        dp = next(g for g in begin.groups if g.name == "dp")
        raised = None
        if phase in args.get("touch_phases", [0, 1, 2]):
            try:
                allreduce_ok(groups["dp"])
            except Exception as exc:  # guard="strict"
                raised = type(exc).__name__
        before = total(policy, "auto_resumes")
        end = policy.end("rollout")
        phases.append({"dp": [dp.action, dp.reason], "raised": raised,
                       "ep": next(g.action for g in begin.groups if g.name == "ep"),
                       "dp_suspended_by_fake": fake.controls.count(fake.comms["dp"], SUSPEND_OP),
                       "auto_resumes": before, "learned": end.learned,
                       "exact": all(allreduce_ok(g) for g in groups.values())})
    return {"phases": phases, "metrics": {k: v for k, v in policy.metrics().items()
                                          if k.startswith("amem/learned/")}}


@scenario
def gil_overlapped_begin(args):
    """An overlapped begin on groups behind torch-shaped backend objects whose
    fake suspend waits for this rank's caller thread to run Python (a gate):
    on the ctypes path the caller runs while every suspend is inside NCCL."""
    from amem_callbacks.backends.nccl import handle_for
    from tests import torch_standins

    init()
    world = dist.get_world_size()
    groups = {}
    for i in range(args.get("groups", 3)):
        groups[f"g{i}"] = dist.new_group(list(range(world)))
        name_group(groups[f"g{i}"], f"g{i}")
    for g in groups.values():
        allreduce_ok(g)
    fake = FakeNccl()
    objects = {}

    def handle_of(group):
        comm, _ = fake.handle_of(group)
        if comm not in objects:
            objects[comm] = torch_standins.make(args["shape"], fake.path, comm)
        return handle_for(objects[comm])

    gate = args.get("gate", True)
    comms = [fake.handle_of(g)[0] for g in groups.values()]
    if gate:
        for comm in comms:
            fake.controls.set_gate(comm)
    warnings = []

    class Count(logging.Handler):
        def emit(self, record):
            if "hold the GIL" in record.getMessage():
                warnings.append(record.getMessage())

    logging.getLogger("amem_callbacks").addHandler(Count())
    backend = NcclBackend(library=fake.library, handle_of=handle_of)
    policy = OffloadPolicy(backend=backend, overlap=True, workers=len(comms), agree_timeout_s=30,
                           timeout_s=60)
    begin = policy.begin("rollout")
    begin_pending = begin.pending
    ran_during = 0
    if gate:
        deadline = time.monotonic() + 30
        for comm in comms:  # open each gate only once its suspend is inside NCCL
            while not fake.controls.in_suspend(comm) and time.monotonic() < deadline:
                ran_during += 0  # spinning in Python: needs the GIL
            while fake.controls.in_suspend(comm) and not fake.controls.gate_timed_out(comm):
                ran_during += 1
                if ran_during % 1000 == 0:
                    break
            fake.controls.open_gate(comm)
    policy.wait()
    timed_out = [fake.controls.gate_timed_out(c) for c in comms]
    paths = [g.path for g in begin.groups if g.action == "suspended"]
    policy.end("rollout")
    policy.wait()
    exact = all(allreduce_ok(g) for g in groups.values())
    return {"gate_timed_out": timed_out, "ran_during_suspend": ran_during,
            "begin_pending": begin_pending, "gil_held": begin.gil_held, "paths": paths,
            "exact_after": exact, "gil_warnings": len(warnings)}


def main() -> None:
    import faulthandler

    faulthandler.enable()  # a crash prints every thread's Python stack into the rank log
    name, args = sys.argv[1], json.loads(sys.argv[2])
    tripwire.install()  # beneath anything the scenario or the package installs
    if os.environ.get(mutations.ENV):  # test_mutations.py only: a deliberately broken package
        mutations.apply(os.environ[mutations.ENV])
    logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ['RANK']}] %(message)s")
    out_path = os.path.join(os.environ["AMEM_TEST_OUT"], f"rank{os.environ['RANK']}.json")
    if ":" in name:  # "tests.other_module:function" for scenarios kept elsewhere
        import importlib

        module, function = name.split(":")
        fn = getattr(importlib.import_module(module), function)
    else:
        fn = SCENARIOS[name]
    try:
        result = {"result": fn(args)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(result, f, default=str)
    if dist.is_initialized():
        # Leave together: rank 0 hosts the store, so it goes last.
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        world = dist.get_world_size()

        def wait_for(key):  # bounded: a scenario may have a dead rank on purpose
            deadline = time.monotonic() + 10
            while int(store.add(key, 0)) < world and time.monotonic() < deadline:
                time.sleep(0.01)

        store.add("amem_test_exit_a", 1)
        wait_for("amem_test_exit_a")
        store.add("amem_test_exit_b", 1)
        if dist.get_rank() == 0:
            wait_for("amem_test_exit_b")
    # The result is written. Skip interpreter teardown: about 1 in 40 multi-rank
    # runs here aborted after this point ("terminate called without an active
    # exception", no Python frame left), which would make a finished scenario
    # look failed. Not yet explained; see the closing notes.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()


# --- issue 33: bad input, second pass (run as "tests.scenarios:NAME": defined after main()) ---

def _nothing_applied(policy) -> dict:
    """What a failed or refused call may leave: the open phase, the groups this
    rank holds, the guard's watch list and whether torch's methods are wrapped."""
    from amem_callbacks import guard

    wrapped = hasattr(dist.ProcessGroup.__dict__.get("allreduce"), "__amem_original__")
    return {"phase_open": phase_open(policy), "held": [v.name for v in policy.groups()],
            "watched": len(guard.watched()), "guard_installed": wrapped}


def longest_waits(args):
    """The largest timeouts the options accept work through whole phases
    (they used to pass construction and overflow at the first begin)."""
    from amem_callbacks import RolloutSession
    from amem_callbacks.checks import MAX_WAIT_S

    groups, fake = fake_groups()
    out = {}
    for overlap in (False, True):
        policy = OffloadPolicy(backend=fake.backend(), keep=["tp"], overlap=overlap,
                               timeout_s=MAX_WAIT_S, agree_timeout_s=MAX_WAIT_S / 2)
        policy.begin("rollout")
        freed = RolloutSession(policy).wait_for_memory(1)
        # the memory wait returns once the first group freed its bytes; with overlap
        # the others may still be suspending (CI caught dp and ep mid-way once)
        policy.wait(MAX_WAIT_S)
        during = fake.suspended()
        policy.end("rollout")
        policy.wait(MAX_WAIT_S)
        out[str(overlap)] = {"freed": freed, "during": during, "after": fake.suspended(),
                             "exact": all(allreduce_ok(g) for g in groups.values()),
                             **_nothing_applied(policy)}
    return out


def nested_phase(args):
    """A phase entered inside another fails at entry and leaves the outer one as
    it was; nothing is learned from it and no group is kept from then on."""
    from amem_callbacks.errors import PhaseError

    groups, fake, policy = fake_job()
    out = {"inner_ran": False}
    with policy.phase("rollout"):
        out["before"] = fake.suspended()
        try:
            with policy.phase("rollout"):
                out["inner_ran"] = True
        except PhaseError as exc:
            out["error"] = str(exc)
        out["after_refusal"] = {"phase_open": phase_open(policy), "suspended": fake.suspended(),
                                "held": [v.name for v in policy.groups()]}
        out["second_begin"] = policy.begin("rollout").skipped  # begin twice: warned, ignored
        out["after_second_begin"] = fake.suspended()
    out["after"] = fake.suspended()
    out["exact"] = all(allreduce_ok(g) for g in groups.values())
    with policy.phase("rollout") as report:
        out["next_phase"] = {g.name: str(g.action) for g in report.groups}
    out.update(auto_resumes=total(policy, "auto_resumes"), learned=learned(policy),
               end=_nothing_applied(policy))
    return out


class _PathOfFails(NcclBackend):
    """A backend that fails after the plan, while the suspend batch is assembled."""

    def path_of(self, handle):
        raise RuntimeError("path_of exploded")


@contextlib.contextmanager
def _store_lost():
    """Every store exchange of the agreement rounds raises meanwhile: the lost
    connection is put on the Agreement class, so the scenario needs no handle on
    the policy's own agreement (which the policy keeps private)."""
    from amem_callbacks.agreement import Agreement

    real = Agreement.exchange

    def lost(self, values):
        raise RuntimeError("store connection lost")

    Agreement.exchange = lost
    try:
        yield
    finally:
        Agreement.exchange = real


def failed_transitions(args):
    """begin/end that raise partway leave no phase open, and name every group
    still held; groups nobody suspended are released (guard off them)."""
    from amem_callbacks import RolloutSession
    from amem_callbacks.checks import MAX_C_INT

    groups, fake = fake_groups()
    out = {}
    # 1. raises while the batch is assembled: the guard watched groups nobody suspends
    broken = _PathOfFails(library=fake.library, handle_of=fake.handle_of)
    policy = OffloadPolicy(backend=broken, agree_timeout_s=20, timeout_s=30)
    try:
        policy.begin("rollout")
    except RuntimeError as exc:
        out["assembly"] = {"error": f"{type(exc).__name__}: {exc}", "suspended": fake.suspended(),
                           **_nothing_applied(policy)}
    # 2. the store fails after every suspend: they stay suspended, the message names them
    policy = OffloadPolicy(backend=fake.backend(), keep=["tp"], agree_timeout_s=20, timeout_s=30)
    with policy.phase("rollout"):
        pass  # sets up the agreement
    try:
        with _store_lost():
            policy.begin("rollout")
    except Exception as exc:
        out["begin"] = {"error": f"{type(exc).__name__}: {exc}", "suspended": fake.suspended(),
                        **_nothing_applied(policy)}
    out["guard_resumes"] = all(allreduce_ok(g) for g in groups.values())
    out["after_guard"] = {"suspended": fake.suspended(), **_nothing_applied(policy)}
    # 3. the store fails after every resume of an end: nothing is held, the error is the store's
    policy.begin("rollout")
    try:
        with _store_lost():
            policy.end("rollout")
    except Exception as exc:
        out["end"] = {"error": f"{type(exc).__name__}: {exc}", "suspended": fake.suspended(),
                      **_nothing_applied(policy)}
    # 4. a device this process does not have: refused at the first begin, before any agreement
    policy = OffloadPolicy(backend="noop", device=MAX_C_INT)
    try:
        policy.begin("rollout")
    except ValueError as exc:
        # nothing set up: a session over it shows no figures before the first set-up
        out["device"] = {"error": f"{type(exc).__name__}: {exc}",
                         "set_up": RolloutSession(policy).metrics() != {},
                         **_nothing_applied(policy)}
    out["exact"] = all(allreduce_ok(g) for g in groups.values())
    return out


def metrics_keys(args):
    """What a user logs after each phase, in plain torch and through the session
    every adapter drives: the same keys; a dry run names what it would do."""
    init()
    from amem_callbacks.session import RolloutSession

    make_groups(dist.get_world_size())
    plain = OffloadPolicy(backend="noop", keep=["tp"], overlap=True, agree_timeout_s=20)
    out = {"before": plain.metrics()}
    for _ in range(2):
        with plain.phase("rollout"):
            time.sleep(0.05)
        out["right_after"] = plain.metrics()
    plain.wait()
    out["settled"] = plain.metrics()
    session = RolloutSession(OffloadPolicy(backend="noop", keep=["tp"], overlap=True,
                                           agree_timeout_s=20))
    for _ in range(2):
        session.start("generate", need_bytes=0)
        time.sleep(0.05)
        session.stop("generate", guarded_until_settle=True)
    session.settle()
    out["session"] = session.metrics()
    return out


def trl_single_process(args):
    """One process, as `python train.py` on one device: no torch.distributed.
    What the callback says, and that training runs unchanged."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # not a launched job
    from trl import GRPOTrainer

    from amem_callbacks import guard
    from amem_callbacks.adapters.trl import AMemCallback
    from tests import scenarios_trl as trl_run

    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append([record.levelname, record.getMessage()])

    logging.getLogger("amem_callbacks").addHandler(Lines(logging.INFO))
    callback = AMemCallback(backend="noop")
    trainer = GRPOTrainer(model=trl_run.model(), reward_funcs=trl_run.reward,
                          args=trl_run.grpo_args(max_steps=2), train_dataset=trl_run.dataset(),
                          processing_class=trl_run.tokenizer(), callbacks=[callback])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # wait() returns the last report (nothing runs in the background here): the
    # begin that found no torch.distributed, and why it did nothing
    return {"lines": lines, "skipped": callback.policy.wait().skipped,
            "distributed": dist.is_initialized(), "steps": len(logs),
            "amem_keys": sorted({k for h in logs for k in h if k.startswith("amem/")}),
            "active": callback.active, "watched": len(guard.watched())}


def phase_body_raises(args):
    """A phase whose body raises leaves its groups suspended (resuming is
    collective); the program goes on, uses one group (the guard resumes it),
    and the next phase resumes the rest first instead of suspending them twice.
    Nothing is learned from the phase that never ended."""
    groups, fake, policy = fake_job()
    out = {}
    try:
        with policy.phase("rollout"):
            raise RuntimeError("generation failed")
    except RuntimeError:
        pass
    out["after_raise"] = {"phase_open": phase_open(policy), "suspended": fake.suspended()}
    out["dp_exact"] = allreduce_ok(groups["dp"])  # the guard resumes dp, collective
    with policy.phase("rollout") as report:
        out["next_phase"] = {g.name: str(g.action) for g in report.groups}
        out["failures"] = total(policy, "failures")
    out.update(after=fake.suspended(), exact=all(allreduce_ok(g) for g in groups.values()),
               learned=learned(policy), end=_nothing_applied(policy))
    return out
