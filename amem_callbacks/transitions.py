"""The suspend and resume batches of one policy.

A batch (one ``begin``, one ``end`` or one guard resume) runs on a serial
worker thread, batches in the order they were submitted. Submissions happen in
the same program order on every rank, so the NCCL calls of all ranks line up.
Inside a batch, ``workers`` threads take groups in key order (the same on every
rank). That cannot deadlock: the lowest-key group not yet past NCCL's barrier is
always held by a thread on each of its ranks, because everything before it
only has local work left.

Each group's operation gives an immutable :class:`GroupOutcome`; a batch hands
its rows and readings up once, as a :class:`BatchResult`, to the ``finish`` its
caller (the policy) gave, which makes the report. Nothing here writes a report.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .decide import AgreedPlan, Setup
from .errors import suspend_left_comm_as_it_was
from .executor import SerialExecutor, Task
from .group_book import GroupBook, GroupState
from .guard_owner import GuardOwner
from .log import logger
from .memory import device_free_bytes, host_rss_bytes
from .report import Counters, GroupReport, group_row
from .states import GuardMode, Outcome, Status


@dataclass(frozen=True)
class Submitted:
    """A queued transition, and whether its caller must wait for it: groups
    reached only through torch's GIL-holding methods cannot overlap anything
    (decided when the batch is queued, from the plan, never by the worker)."""

    task: Task
    must_wait: bool
    #: names of the groups it moves, in the order it moves them
    planned: tuple = ()


@dataclass(frozen=True)
class GroupOutcome:
    """What one group's operation did: its action, why it failed (``error``), a
    reason for the report (None: the row's own), and how long it took."""

    action: Outcome
    error: Optional[str] = None
    reason: Optional[str] = None
    seconds: float = 0.0

    def on(self, row: GroupReport) -> GroupReport:
        """The row with this outcome in it (a new row: rows are never changed)."""
        changes = dict(action=self.action, error=self.error, seconds=self.seconds)
        if self.reason is not None:
            changes["reason"] = self.reason
        return dataclasses.replace(row, **changes)


@dataclass(frozen=True)
class BatchResult:
    """What one batch did on this rank: a row per group it moved, the device and
    host readings around it, and when its held suspends started (None: not held)."""

    rows: tuple
    device_free_before: Optional[int]
    device_free_after: Optional[int]
    host_rss_before: Optional[int]
    host_rss_after: Optional[int]
    held_until: Optional[float] = None


@dataclass(frozen=True)
class WorkItem:
    """One group's operation in a batch: the group's state, the row its outcome
    fills, and the event this operation sets when it has run (a later operation
    queued on the group gets a new ``state.finished``; this one keeps its own)."""

    state: GroupState
    row: GroupReport
    done: threading.Event


#: What a suspend may take per GiB, for the hint below: NCCL pins host memory for
#: the backup of every suspended byte, slower by far on a host whose memory is not
#: mapped yet (the first suspend after it started). docs/evidence.md has the runs.
WARM_SUSPEND_S_PER_GIB, COLD_SUSPEND_S_PER_GIB = 0.7, 16.4 / 4.5


def slow_suspend_hint(nbytes: int, elapsed_s: float) -> str:
    """Why a suspend may outlast a timeout chosen for a warm host, and the fix."""
    gib = nbytes / 2**30
    return (f"This rank's begin has been suspending {gib:.2f} GiB for {elapsed_s:.1f} s. NCCL "
            f"copies every suspended byte to pinned host memory: about "
            f"{WARM_SUSPEND_S_PER_GIB:g} s/GiB on a warm host, but the first suspend after a "
            f"host starts can take {COLD_SUSPEND_S_PER_GIB:.1f} s/GiB "
            f"while the host's memory is still being mapped, here about "
            f"{COLD_SUSPEND_S_PER_GIB * gib:.0f} s. If every rank is alive, raise timeout_s "
            f"(or agree_timeout_s) above that.")


class Transitions:
    """Runs agreed plans as batches on the policy's worker. The groups it holds are
    in ``book`` (group_book.py); the guard's questions about them go to ``owner``
    (guard_owner.py), whose resumes run here too."""

    def __init__(self, setup: Setup, options, counters: Counters):
        self.backend = setup.backend
        self.agreement = setup.agreement
        self.device = setup.device
        self.counters = counters
        self.workers = options.workers
        self.executor = SerialExecutor()
        self.book = GroupBook(setup.backend, options.timeout_s,
                              guarded=options.guard != GuardMode.OFF)
        self.owner = GuardOwner(self.book, self, counters,
                                strict=options.guard == GuardMode.STRICT)
        self._warned_gil = False
        # The latest begin's go-ahead: clear while its suspends are held (begin's hold_s).
        self._go = threading.Event()
        self._go.set()
        # Bytes the latest begin has freed so far on this rank, for wait_for_bytes.
        self._progress = threading.Condition()
        self._freed_bytes = 0
        self._begin_running = False
        # The running begin's start and bytes, for the slow-first-suspend hint.
        self._begin_since: Optional[float] = None
        self._begin_bytes = 0

    def row(self, state: GroupState, action: Outcome, reason: str = "") -> GroupReport:
        """The report row of an operation on ``state``, before it runs."""
        return group_row(state.info, action, reason, suspendable=state.suspendable,
                         path=self.backend.path_of(state.info.handle))

    # --- begin -----------------------------------------------------------
    def begin(self, plan: AgreedPlan, hold_s: float,
              finish: Callable[[BatchResult], object]) -> Submitted:
        """Queue the suspend batch of an agreed plan (the agreement is done); its
        result goes to ``finish`` on the worker. With ``hold_s``, the batch waits up
        to that long for :meth:`start_held` (or for anything that needs it over: an
        end, a wait, the guard)."""
        work = [WorkItem(s, self.row(s, Outcome.SUSPENDED), s.finished)
                for s in self.book.take(plan)]
        must_wait = self._holds_gil(work)
        go = threading.Event()
        if hold_s <= 0 or not work:
            go.set()
        self._go = go
        with self._progress:
            self._freed_bytes, self._begin_running = 0, True
            self._begin_since = time.monotonic()
            self._begin_bytes = sum(item.state.suspendable or 0 for item in work)

        def suspend_when_let_go():
            held_until = None
            if not go.is_set():
                go.wait(hold_s)
                held_until = time.monotonic()
                with self._progress:  # the slow-suspend hint counts from here
                    self._begin_since = held_until
            result = self._batch([work], self.suspend_one, self._close_begin, must_wait,
                                 begin=True)
            return finish(dataclasses.replace(result, held_until=held_until))

        task = self.executor.submit(suspend_when_let_go, "begin transition")
        return Submitted(task, must_wait, tuple(item.state.info.name for item in work))

    def start_held(self) -> bool:
        """Let the latest begin's held suspends start now; whether they were held."""
        held = not self._go.is_set()
        self._go.set()
        return held

    def holding(self) -> bool:
        """The latest begin's suspends are held (not started yet)."""
        return not self._go.is_set()

    def wait_for_bytes(self, nbytes: int, timeout_s: float) -> int:
        """Block until the running begin has freed ``nbytes`` on this rank (by
        NCCL's account) or has finished; returns the bytes freed so far."""
        from .errors import TransitionTimeout

        deadline = time.monotonic() + timeout_s
        self.start_held()  # waiting for them is needing them
        with self._progress:
            while self._begin_running and self._freed_bytes < nbytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransitionTimeout(
                        f"waiting for {nbytes / 2**20:.0f} MiB to be freed: only "
                        f"{self._freed_bytes / 2**20:.0f} MiB after {timeout_s:g} s; a peer "
                        "rank is probably missing, dead or in a different phase. "
                        + self._suspend_hint_locked())
                self._progress.wait(left)
            return self._freed_bytes

    def _freed(self, nbytes: int, done: bool = False) -> None:
        with self._progress:
            self._freed_bytes += nbytes
            if done:
                self._begin_running = False
                self._begin_since = None
            self._progress.notify_all()

    def suspend_hint(self) -> str:
        """For a timeout's message while a begin runs: a first suspend on a freshly
        started host can be slow, and a timeout set for a warm one trips on it."""
        with self._progress:
            return self._suspend_hint_locked()

    def _suspend_hint_locked(self) -> str:
        if self._begin_since is None:
            return ""
        return slow_suspend_hint(self._begin_bytes, time.monotonic() - self._begin_since)

    def _holds_gil(self, work) -> bool:
        """Groups reachable only through torch's GIL-holding methods: no thread
        of this process runs while one of their calls waits in NCCL, so worker
        threads and overlap would only stall; worse, a worker holding the GIL in
        a barrier could keep this rank from issuing the very collective a peer's
        barrier waits for. Their batch runs one call at a time and the caller
        waits for it. Returns whether it must."""
        held = [item.state.info for item in work if self.backend.holds_gil(item.state.info.handle)]
        if not held:
            return False
        if not self._warned_gil:
            self._warned_gil = True
            why = held[0].handle.why
            logger.warning("amem_callbacks: group(s) %s are reached only through torch's own "
                           "suspend()/resume(), which hold the GIL (%s): their transitions run "
                           "one at a time and begin/end wait for them; overlap does not apply. "
                           "Fix: a torch whose NCCL backend gives its communicator pointer "
                           "(the default 'nccl' of torch 2.11-2.15; not torch 2.14's opt-in "
                           "nccl2)", [info.name for info in held], why)
        return True

    # --- running a batch -------------------------------------------------
    def bind_device(self) -> None:
        """Make the caller's GPU current in this worker thread before any CUDA or
        NCCL call. A new thread starts on device 0: an NCCL or CUDA call there
        made every other rank create a CUDA context on GPU 0 (measured: ~535 MiB
        of GPU 0 gone for good, seen as a freed fraction of 0.86 on rank 0)."""
        if self.device is not None:
            import torch  # light import: only a pool thread of a policy with a device

            torch.cuda.set_device(self.device)

    def _batch(self, tiers, op: Callable, close: Callable, serial: bool,
               begin: bool = False) -> BatchResult:
        """Run ``op`` over the tiers one after the other, each tier's groups in
        the given order (the same on every rank), on ``workers`` threads (one at a
        time where ``serial``); then ``close`` (the members' agreement on how it
        went). The rows and readings, handed up once."""
        self.bind_device()
        free_before, rss_before = device_free_bytes(self.device), host_rss_bytes()
        work = [item for tier in tiers for item in tier]
        outcomes: dict = {}
        try:
            for tier in tiers:
                if serial or self.workers <= 1 or len(tier) <= 1:
                    for item in tier:
                        outcomes[id(item)] = self.run_op(op, item.state, item.done)
                else:
                    self._run_pool(op, tier, outcomes)
            outcomes = close(work, outcomes)
        finally:
            if begin:
                self._freed(0, done=True)
        rows = tuple(outcomes[id(item)].on(item.row) for item in work)
        return BatchResult(rows, free_before, device_free_bytes(self.device), rss_before,
                           host_rss_bytes())

    def run_op(self, op: Callable, state: GroupState, done: threading.Event) -> GroupOutcome:
        """Run one operation and signal *its own* event: a later operation may
        already be queued on the group with a newer ``state.finished``."""
        start = time.monotonic()
        try:
            outcome = op(state)
        finally:
            seconds = time.monotonic() - start
            done.set()
        return dataclasses.replace(outcome, seconds=seconds)

    def _run_pool(self, op: Callable, work, outcomes: dict) -> None:
        queue = iter(work)
        lock = threading.Lock()

        def take_in_key_order():
            self.bind_device()
            while True:
                with lock:
                    item = next(queue, None)
                if item is None:
                    return
                outcome = self.run_op(op, item.state, item.done)
                with lock:
                    outcomes[id(item)] = outcome

        threads = [threading.Thread(target=take_in_key_order, name=f"amem-transition-{i}",
                                    daemon=True) for i in range(min(self.workers, len(work)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # --- the operations --------------------------------------------------
    def suspend_one(self, state: GroupState) -> GroupOutcome:
        try:
            self.backend.suspend(state.info.handle)
            state.status = Status.SUSPENDED
            if self.backend.dry_run:
                self.counters.add("would_suspends")
                return GroupOutcome(Outcome.WOULD_SUSPEND)
            self.counters.add("group_suspends")
            self._freed(state.suspendable or 0)
            return GroupOutcome(Outcome.SUSPENDED)
        except Exception as exc:
            self.counters.add("failures")
            if suspend_left_comm_as_it_was(exc):
                logger.error("amem_callbacks: suspending group %r failed before it changed "
                             "anything, it stays active: %s", state.info.name, exc)
                self.book.mark_active(state)
                return GroupOutcome(Outcome.FAILED, error=str(exc))
            # Never undone here: a resume is collective (every member must call it) and
            # NCCL refuses one on a partly suspended communicator. Its members decide
            # together in _close_begin; until then no call may reach it.
            why = f"its suspend failed part-way: {exc}"
            self.book.mark_broken(state, why)
            return GroupOutcome(Outcome.FAILED, error=why)

    def resume_one(self, state: GroupState) -> GroupOutcome:
        if state.status is Status.BROKEN:
            return GroupOutcome(Outcome.FAILED, error=state.error)
        if state.status is not Status.SUSPENDED:  # its suspend failed and was undone
            return GroupOutcome(Outcome.KEPT, reason="its suspend had failed")
        return self._resume_or_break(state)

    def _resume_or_break(self, state: GroupState) -> GroupOutcome:
        try:
            self.backend.resume(state.info.handle)
        except Exception as first:
            memory = self.book.memory(state)
            if memory is not None and not memory.suspended:
                logger.warning("amem_callbacks: resume of %r reported %s but it is active",
                               state.info.name, first)
            else:
                try:
                    self.backend.resume(state.info.handle)
                except Exception as second:
                    self.counters.add("failures")
                    why = f"resume failed twice: {first}; {second}"
                    self.book.mark_broken(state, why)
                    return GroupOutcome(Outcome.FAILED, error=why)
        self.book.mark_active(state)
        if self.backend.dry_run:
            self.counters.add("would_resumes")
            return GroupOutcome(Outcome.WOULD_RESUME)
        self.counters.add("group_resumes")
        return GroupOutcome(Outcome.RESUMED)

    def _peer_outcomes(self, work, succeeded: Callable, what: str):
        """Collective over each group's members: share whether this rank's operation
        succeeded ("ok", else "failed", or "part-way" where it left the group broken);
        yield ``(item, {failed rank: how}, {member: outcome}, reason)`` per group (a
        member that did not report in time has None; ``reason`` then says so)."""
        outcomes = self.agreement.exchange(
            {i.state.info.key: (i.state.info.ranks, "ok" if succeeded(i.state) else
                                "part-way" if i.state.status is Status.BROKEN else "failed")
             for i in work})
        for item in work:
            state = item.state
            peers = outcomes.get(state.info.key, {})
            missing = [r for r, v in peers.items() if v is None]
            reason = None
            if missing:  # in the report too: the next call on this group may fail or hang
                reason = (f"rank(s) {missing} did not report {what} it within "
                          f"{self.agreement.timeout_s:g} s (dead or late)")
                if what == "suspending":  # late is likely on a freshly started host
                    reason += ". " + self.suspend_hint()
                logger.warning("amem_callbacks: group %r: %s", state.info.name, reason)
            yield item, {r: v for r, v in peers.items() if v not in ("ok", None)}, peers, reason

    def _close_begin(self, work, outcomes: dict) -> dict:
        """Every member learns how the others' suspends went and all take the same
        state: suspended where all suspended, active where every failure left its
        communicator as it was, else broken everywhere. Never a resume on some members
        only: NCCL's resume waits for every member, and a member whose suspend failed
        part-way cannot resume (mem_manager.cc), so the others would wait forever."""
        closed = {}
        for item, failed, peers, reason in self._peer_outcomes(
                work, lambda s: s.status is Status.SUSPENDED, "suspending"):
            state, outcome = item.state, outcomes[id(item)]
            if reason is not None:
                outcome = dataclasses.replace(outcome, reason=reason)
            mixed = "ok" in peers.values() or "part-way" in failed.values()
            if failed and mixed and state.status is not Status.BROKEN:
                if state.status is not Status.SUSPENDED:  # active here: watched again
                    self.book.watch_again(state)
                how = ("part-way" if "part-way" in failed.values()
                       else "while other members suspended it")
                why = (f"rank(s) {sorted(failed)} failed to suspend it {how}; NCCL cannot "
                       "undo that, and a resume here would wait for them forever")
                self.book.mark_broken(state, why)
                outcome = dataclasses.replace(outcome, action=Outcome.FAILED, error=why)
            closed[id(item)] = outcome
        return closed

    # --- end -------------------------------------------------------------
    def end(self, finish: Callable[[BatchResult], object]) -> Submitted:
        """Collective: queue a resume for every group this policy holds suspended,
        the groups agreed as ``first`` before the others (held suspends run first:
        every member of a group must suspend it, NCCL waits for all of them); its
        result goes to ``finish`` on the worker."""
        self.start_held()
        work = []
        for state in self.book.to_resume():
            state.resume_queued = True
            state.finished = threading.Event()
            work.append(WorkItem(state, self.row(state, Outcome.RESUMED), state.finished))
        must_wait = self._holds_gil(work)
        tiers = [[i for i in work if i.state.first], [i for i in work if not i.state.first]]
        task = self.executor.submit(
            lambda: finish(self._batch([t for t in tiers if t], self.resume_one,
                                       self._close_end, must_wait)),
            "end transition")
        return Submitted(task, must_wait, tuple(item.state.info.name for item in work))

    def _close_end(self, work, outcomes: dict) -> dict:
        closed = {}
        for item, failed, _peers, reason in self._peer_outcomes(
                work, lambda s: s.status is not Status.BROKEN, "resuming"):
            state, outcome = item.state, outcomes[id(item)]
            if reason is not None:
                outcome = dataclasses.replace(outcome, reason=reason)
            if failed and state.status is not Status.BROKEN:
                # Unusable on a peer: a call here would wait for it forever, so raise instead.
                self.book.watch_again(state)
                why = f"rank(s) {sorted(failed)} could not resume it"
                self.book.mark_broken(state, why)
                outcome = dataclasses.replace(outcome, action=Outcome.FAILED, error=why)
            closed[id(item)] = outcome
        return closed
