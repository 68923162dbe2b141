"""Scenarios of a begin that holds its suspends (``begin(hold_s=...)``): agreed at
the call, started by ``start_suspends``, by whatever needs them over, or by the
bound. Run as ``tests.scenarios_held:NAME`` by tests/test_held_begin.py on gloo
ranks with the fake NCCL, whose suspends and resumes here wait for the group's other
members as NCCL's do (a bootstrap barrier): a rank that lets go first waits for the
others in the background. tests/gpu/suspend_stall_gpu.py's held mode runs ranks that
let go at different moments on real NCCL."""

from __future__ import annotations

import time

import torch.distributed as dist

from amem_callbacks import OffloadPolicy, RolloutSession
from tests.fake_nccl import RESUME_OP, SUSPEND_OP
from tests.scenarios import allreduce_ok, fake_groups

HOLD_S = 30.0  # longer than any scenario: only what the scenario does starts them


def _policy(fake):
    return OffloadPolicy(backend=fake.backend(), keep=["tp"], overlap=True,
                         agree_timeout_s=20, timeout_s=30)


def _counts(fake) -> dict:
    return {name: [fake.controls.count(c, SUSPEND_OP), fake.controls.count(c, RESUME_OP)]
            for name, c in sorted(fake.comms.items())}


def _all_suspended_within(fake, seconds: float) -> float:
    """Seconds until every non-kept fake communicator is suspended (polling, no
    wait on the policy: a wait would start them itself); -1 if not by then."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        states = fake.suspended()
        if all(v for k, v in states.items() if k != "tp"):
            return time.monotonic() - began
        time.sleep(0.01)
    return -1.0


def started_by_each_rank(args):
    """Held until each rank calls start_suspends, rank 1 later than rank 0: nothing
    is suspended before, everything after, and letting go never blocks the caller."""
    groups, fake = fake_groups(peers=True)
    session = RolloutSession(_policy(fake))
    report = session.start("generate", need_bytes=0, hold_s=HOLD_S)
    summary_while_held = report.summary()
    time.sleep(0.3)
    before = {"suspended": fake.suspended(), "counts": _counts(fake),
              "freed": session.freed().done, "pending": report.pending}
    kept_ok = allreduce_ok(groups["tp"])  # the kept group is usable while held
    time.sleep(0.5 * dist.get_rank())  # rank 1 lets go 0.5 s after rank 0
    let_go = time.monotonic()
    started = session.start_suspends("first step")
    caller_back_s = time.monotonic() - let_go  # never blocks, even waiting for the peer
    suspended_after_s = _all_suspended_within(fake, 10)
    again = session.start_suspends("twice")
    begin = session.policy.wait()
    end = session.stop("generate")
    session.policy.wait()
    return {"before": before, "kept_ok": kept_ok, "started": started, "again": again,
            "caller_back_s": caller_back_s, "suspended_after_s": suspended_after_s,
            "summary_while_held": summary_while_held, "held_seconds": begin.held_seconds,
            "flat": begin.as_dict(), "summary": begin.summary(),
            "begin": {g.name: str(g.action) for g in begin.groups},
            "end": {g.name: str(g.action) for g in end.groups},
            "after": fake.suspended(), "counts": _counts(fake),
            "exact": all(allreduce_ok(g, 2.0) for g in groups.values())}


def started_by_what_needs_them(args):
    """Nobody calls start_suspends: ``how`` starts them. end: suspended then resumed
    (every member must suspend before any resumes); wait: the begin finishes; guard: a
    collective on a held group suspends it as agreed, then resumes it for the call;
    memory: a wait for freed bytes; bound: hold_s passes."""
    how = args["how"]
    groups, fake = fake_groups(peers=True)
    policy = _policy(fake)
    session = RolloutSession(policy)
    hold_s = 0.4 if how == "bound" else HOLD_S
    report = session.start("generate", need_bytes=0, hold_s=hold_s)
    time.sleep(0.2)
    held_early = not any(fake.suspended().values())
    out = {"held_early": held_early}
    began = time.monotonic()
    if how == "end":
        session.stop("generate")
        policy.wait()
    elif how == "wait":
        policy.wait()
        out["during"] = fake.suspended()
    elif how == "guard":
        out["dp_ok"] = allreduce_ok(groups["dp"], 3.0)
        out["dp_view"] = None if policy.view(groups["dp"]) is None else str(
            policy.view(groups["dp"]).status)
    elif how == "memory":
        out["freed"] = session.wait_for_memory(1)
    elif how == "bound":
        out["suspended_after_s"] = _all_suspended_within(fake, 10)
    out["seconds"] = time.monotonic() - began
    if session.active:
        session.stop("generate")
        policy.wait()
    metrics = policy.metrics()
    out.update(held_seconds=report.held_seconds, counts=_counts(fake), after=fake.suspended(),
               auto_resumes=metrics["amem/total/auto_resumes"],
               guard_waits={k: v for k, v in metrics.items() if k.startswith("amem/guard_wait/")},
               exact=all(allreduce_ok(g, 2.0) for g in groups.values()))
    return out


def held_then_cycles(args):
    """Held begins in a row, each started at another moment, with a plain begin between:
    every round of the agreement stays in step on both ranks (the same plans, exact
    collectives, one suspend and one resume per cycle)."""
    groups, fake = fake_groups(peers=True)
    policy = _policy(fake)
    rows = []
    for cycle in range(4):
        hold_s = 0.0 if cycle == 2 else HOLD_S
        policy.begin("rollout", hold_s=hold_s)
        time.sleep(0.05 * ((cycle + dist.get_rank()) % 2))
        policy.start_suspends()
        begin = policy.wait()
        end = policy.end("rollout")
        policy.wait()
        rows.append({"suspended": sorted(g.name for g in begin.suspended),
                     "resumed": sorted(g.name for g in end.groups if str(g.action) == "resumed"),
                     "exact": all(allreduce_ok(g, cycle + 2) for g in groups.values())})
    return {"rows": rows, "counts": _counts(fake)}


def allocating(args):
    """``start(allocating_bytes=...)``: the caller allocates right after; the free
    memory before the begin is ``args["free"]`` (None: unknown). The fake suspends
    (they run side by side) take 0.3 s (world), 0.6 s (dp) and 0.9 s (ep), so the
    caller's wait shows what it waited for."""
    import amem_callbacks.session as session_module

    groups, fake = fake_groups(peers=True)
    for name, delay_s in (("world", 0.3), ("dp", 0.6), ("ep", 0.9)):
        fake.controls.delay(fake.handle_of(groups[name])[0], int(delay_s * 1e6))
    session_module.device_free_bytes = lambda device=None: args["free"]
    session = RolloutSession(_policy(fake))
    began = time.monotonic()
    report = session.start("KV wake-up", allocating_bytes=args["allocating"])
    out = {"back_s": time.monotonic() - began, "suspended_at_return": fake.suspended(), "waited_for_bytes": report.waited_for_bytes,
           "pending_at_return": report.pending, "freed_at_return": session.freed().nbytes,
           "shared_by": report.device_shared_by}
    session.policy.wait()
    out["flat"] = report.as_dict()
    session.stop("KV wake-up")
    session.policy.wait()
    out.update(counts=_counts(fake), after=fake.suspended(),
               exact=all(allreduce_ok(g, 2.0) for g in groups.values()))
    return out


def allocating_twice(args):
    """Two phases told what comes next: the first always begins; the second is skipped
    on every rank when no rank lacks memory (``args["second"]``: each rank's free
    memory then, None unknown), else every rank begins."""
    import amem_callbacks.session as session_module

    groups, fake = fake_groups(peers=True)
    session = RolloutSession(_policy(fake))
    frees = [64 * 2**30, args["second"][dist.get_rank()]]
    session_module.device_free_bytes = lambda device=None: frees[0]
    first = session.start("KV wake-up", allocating_bytes=100 * 2**20)
    session.stop("KV wake-up")
    session.policy.wait()
    frees.pop(0)
    second = session.start("KV wake-up", allocating_bytes=100 * 2**20)
    out = {"first_skipped": first.skipped, "second_skipped": second.skipped,
           "second_waited": second.waited_for_bytes, "active": session.active}
    out["stop"] = session.stop("KV wake-up") is not None
    session.policy.wait()
    out.update(counts=_counts(fake), after=fake.suspended(),
               not_needed=session.metrics()["amem/total/begins_not_needed"],
               exact=all(allreduce_ok(g, 2.0) for g in groups.values()))
    return out
