"""The suspend and resume batches of one policy, and what the guard asks of them.

A batch (one ``begin``, one ``end`` or one guard resume) runs on a serial
worker thread, batches in the order they were submitted. Submissions happen in
the same program order on every rank, so the NCCL calls of all ranks line up.
Inside a batch, ``workers`` threads take groups in key order (the same on every
rank). That cannot deadlock: the lowest-key group not yet past NCCL's barrier is
always held by a thread on each of its ranks, because everything before it
only has local work left.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import guard
from .decide import PROCESS_KEY, AgreedPlan, Setup
from .errors import SuspendedGroupError, TransitionTimeout, suspend_left_comm_as_it_was
from .executor import SerialExecutor, Task
from .groups import GroupInfo
from .log import logger
from .memory import device_free_bytes, host_rss_bytes
from .report import Counters, GroupReport, GroupView, TransitionReport
from .states import GuardMode, Kind, Outcome, Status



@dataclass(frozen=True)
class Submitted:
    """A queued transition, and whether its caller must wait for it: groups
    reached only through torch's GIL-holding methods cannot overlap anything
    (decided when the batch is queued, from the plan, never by the worker)."""

    task: Task
    must_wait: bool


@dataclass
class GroupState:
    """A group this policy has suspended or is suspending.

    ``status`` is written by the worker only; ``resume_queued`` by the caller
    (``end`` or the guard); ``finished`` is set once the latest operation
    queued on the group has run.
    """

    info: GroupInfo
    timeout_s: float
    status: Status = Status.SUSPENDING
    resume_queued: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None
    suspendable: Optional[int] = None
    #: every process group whose calls depend on this state (several for AMem)
    covers: tuple = ()
    #: resumed before the others at the end (agreed by its members)
    first: bool = False

    def wait(self, what: str, hint: str = "") -> None:
        if not self.finished.wait(self.timeout_s):
            raise TransitionTimeout(
                f"{what} on group {self.info.name!r} did not finish within {self.timeout_s:g} s: "
                "a peer rank is probably missing, dead or in a different phase. Stop the job."
                + (f" {hint}" if hint else ""))


#: where a group's own c10d timeout cannot be read: torch's default for a process
#: group (30 min), the bound a collective on that group would have had anyway
FALLBACK_TIMEOUT_S = 1800.0
_warned_timeout: list = []


@dataclass(frozen=True)
class WorkItem:
    """One group's operation in a batch: the group's state, the report row it
    fills, and the event this operation sets when it has run (a later operation
    queued on the group gets a new ``state.finished``; this one keeps its own)."""

    state: GroupState
    report: GroupReport
    done: threading.Event


#: measured on one H200 (NCCL 2.30.7, 2 ranks): a suspend pins host memory for
#: NCCL's backup of every suspended byte, about 0.7 s/GiB on a warm host; the
#: first suspend after the host started took 16.4 s for 4.5 GiB (FIELD-NOTES §8, §9)
WARM_SUSPEND_S_PER_GIB, COLD_SUSPEND_S_PER_GIB = 0.7, 16.4 / 4.5


def slow_suspend_hint(nbytes: int, elapsed_s: float) -> str:
    """Why a suspend may outlast a timeout chosen for a warm host, and the fix."""
    gib = nbytes / 2**30
    return (f"This rank's begin has been suspending {gib:.2f} GiB for {elapsed_s:.1f} s. NCCL "
            f"copies every suspended byte to pinned host memory: about "
            f"{WARM_SUSPEND_S_PER_GIB:g} s/GiB on a warm host, but the first suspend after a "
            f"host starts can take {COLD_SUSPEND_S_PER_GIB:.1f} s/GiB (measured: 16.4 s for "
            f"4.5 GiB) while the host's memory is still being mapped, here about "
            f"{COLD_SUSPEND_S_PER_GIB * gib:.0f} s. If every rank is alive, raise timeout_s "
            f"(or agree_timeout_s) above that.")


def group_timeout_s(group) -> float:
    """The c10d timeout of a group's backend (NCCL's; gloo's for the CPU
    stand-in): a transition on the group is bounded by what a collective on it
    would be.

    torch has no public getter for it, so this reads the backend's
    ``options._timeout``; if torch renames it, one warning says the fallback
    and how to set the bound (``timeout_s=``) instead of every timeout quietly
    becoming 30 minutes."""
    import torch  # light import: torch at use

    for device in ("cuda", "cpu"):
        try:
            backend = group._get_backend(torch.device(device))
        except Exception:  # no backend for this device type on the group
            continue
        try:  # a huge init_process_group(timeout=) must not overflow a wait
            return min(backend.options._timeout.total_seconds(), threading.TIMEOUT_MAX)
        except AttributeError as exc:  # torch moved the private field: say so once
            if not _warned_timeout:
                _warned_timeout.append(True)
                logger.warning("amem_callbacks: cannot read a group's c10d timeout (%s); "
                               "transitions are bounded by %.0f s instead. Set timeout_s= "
                               "to choose the bound", exc, FALLBACK_TIMEOUT_S)
            break
    return FALLBACK_TIMEOUT_S


class Transitions:
    """Executes agreed plans: owns the state of every group it suspended, and
    is the guard's owner of those groups (:class:`guard.GroupOwner`)."""

    def __init__(self, setup: Setup, options, counters: Counters):
        self.backend = setup.backend
        self.agreement = setup.agreement
        self.device = setup.device
        self.timeout_s = options.timeout_s
        self.counters = counters
        self.workers = options.workers
        self.strict = options.guard == GuardMode.STRICT  # raise instead of resuming
        self.guarded = options.guard != GuardMode.OFF  # guard='off': calls are not intercepted
        self.executor = SerialExecutor()
        self.states: dict = {}  # key -> GroupState, for groups not known to be active
        self.auto_resumed: list = []  # GroupReports of guard resumes since the last end()
        self._guard_resumes: dict = {}  # group key -> (name, count) since the last end()
        self._warned_auto: set = set()
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

    # --- begin -----------------------------------------------------------
    def begin(self, report: TransitionReport, plan: AgreedPlan, hold_s: float = 0.0) -> Submitted:
        """Queue the suspend batch of an agreed plan (the agreement is done). With
        ``hold_s``, the batch waits up to that long for :meth:`start_held` (or for
        anything that needs it over: an end, a wait, the guard)."""
        report.agree_seconds = plan.agree_seconds
        for info, reason in plan.kept:
            report.groups.append(_group_report(info, Outcome.KEPT, reason))
        work = [WorkItem(s, _group_report(s.info, Outcome.SUSPENDED, suspendable=s.suspendable,
                                          path=self.backend.path_of(s.info.handle)), s.finished)
                for s in self._new_states(plan)]
        report.planned = [item.state.info.name for item in work]
        must_wait = self._note_gil(report, work)
        go = threading.Event()
        if hold_s <= 0 or not work:
            go.set()
        self._go = go
        with self._progress:
            self._freed_bytes, self._begin_running = 0, True
            self._begin_since = time.monotonic()
            self._begin_bytes = sum(item.state.suspendable or 0 for item in work)

        def suspend_when_let_go():
            if not go.is_set():
                go.wait(hold_s)
                report.held_seconds = time.monotonic() - report.started
                with self._progress:  # the slow-suspend hint counts from here
                    self._begin_since = time.monotonic()
            return self._batch(report, [work], self._suspend, self._close_begin)

        task = self.executor.submit(suspend_when_let_go, "begin transition")
        return Submitted(task, must_wait)

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

    def _note_gil(self, report: TransitionReport, work) -> bool:
        """Groups reachable only through torch's GIL-holding methods: no thread
        of this process runs while one of their calls waits in NCCL, so worker
        threads and overlap would only stall; worse, a worker holding the GIL in
        a barrier could keep this rank from issuing the very collective a peer's
        barrier waits for. Their batch runs one call at a time and the caller
        waits for it. Returns whether it must."""
        held = [item.state.info for item in work if self.backend.holds_gil(item.state.info.handle)]
        if not held:
            return False
        report.gil_held = True
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

    def _new_states(self, plan: AgreedPlan) -> list:
        states = []
        for item in plan.suspend:
            info = item.info
            suspendable = (item.nbytes if info.key == PROCESS_KEY else
                           info.memory.suspendable if info.memory else None)
            state = GroupState(info=info, covers=item.covers, suspendable=suspendable,
                               first=item.first,
                               timeout_s=self.timeout_s or group_timeout_s(info.group))
            self.states[info.key] = state
            if self.guarded:
                for group in item.covers:
                    guard.watch(group, self)
            states.append(state)
        return states

    # --- running a batch -------------------------------------------------
    def _bind_device(self) -> None:
        """Make the caller's GPU current in this worker thread before any CUDA or
        NCCL call. A new thread starts on device 0: an NCCL or CUDA call there
        made every other rank create a CUDA context on GPU 0 (measured: ~535 MiB
        of GPU 0 gone for good, seen as a freed fraction of 0.86 on rank 0)."""
        if self.device is not None:
            import torch  # light import: only a pool thread of a policy with a device

            torch.cuda.set_device(self.device)

    def _batch(self, report: TransitionReport, tiers, op: Callable, close: Callable):
        """Run ``op`` over the tiers one after the other, each tier's groups in
        the given order (the same on every rank), on ``workers`` threads."""
        self._bind_device()
        self._measure(report, "before")
        work = [item for tier in tiers for item in tier]
        try:
            for tier in tiers:
                if self.workers <= 1 or len(tier) <= 1 or report.gil_held:
                    for item in tier:
                        self._run_op(op, item)
                else:
                    self._run_pool(op, tier)
            close(report, work)
        finally:
            if report.kind is Kind.BEGIN:
                self._freed(0, done=True)
        report.groups.sort(key=lambda g: g.key)
        self._measure(report, "after")
        return self._finish(report)

    def _run_op(self, op: Callable, item: WorkItem) -> None:
        """Run one operation and signal *its own* event: a later operation may
        already be queued on the group with a newer ``state.finished``."""
        start = time.monotonic()
        try:
            op(item.state, item.report)
        finally:
            item.report.seconds = time.monotonic() - start
            item.done.set()

    def _run_pool(self, op: Callable, work) -> None:
        queue = iter(work)
        lock = threading.Lock()

        def take_in_key_order():
            self._bind_device()
            while True:
                with lock:
                    item = next(queue, None)
                if item is None:
                    return
                self._run_op(op, item)

        threads = [threading.Thread(target=take_in_key_order, name=f"amem-transition-{i}",
                                    daemon=True) for i in range(min(self.workers, len(work)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _measure(self, report: TransitionReport, when: str) -> None:
        setattr(report, f"device_free_{when}", device_free_bytes(self.device))
        setattr(report, f"host_rss_{when}", host_rss_bytes())

    def _finish(self, report: TransitionReport) -> TransitionReport:
        moved = [g for g in report.groups if g.action in (
            Outcome.SUSPENDED, Outcome.RESUMED, Outcome.WOULD_SUSPEND, Outcome.WOULD_RESUME,
            Outcome.FAILED)]
        report.total_seconds = report.agree_seconds + sum(g.seconds for g in moved)
        report.wall_seconds = time.monotonic() - report.started
        self.counters.add("transition_seconds", report.total_seconds)
        # On a shared GPU the reading is the whole device's, not this rank's: not counted.
        if (report.kind is Kind.BEGIN and report.device_freed_bytes is not None
                and report.device_shared_by <= 1):
            self.counters.record_freed(report.device_freed_bytes)
        report.pending = False
        logger.info("amem_callbacks: %s", report.summary())
        return report

    # --- the operations --------------------------------------------------
    def _suspend(self, state: GroupState, rep: GroupReport) -> None:
        try:
            self.backend.suspend(state.info.handle)
            state.status = Status.SUSPENDED
            if self.backend.dry_run:
                rep.action = Outcome.WOULD_SUSPEND
                self.counters.add("would_suspends")
            else:
                rep.action = Outcome.SUSPENDED
                self.counters.add("group_suspends")
                self._freed(state.suspendable or 0)
        except Exception as exc:
            rep.action, rep.error = Outcome.FAILED, str(exc)
            self.counters.add("failures")
            if suspend_left_comm_as_it_was(exc):
                logger.error("amem_callbacks: suspending group %r failed before it changed "
                             "anything, it stays active: %s", state.info.name, exc)
                self._mark_active(state)
            else:
                # Never undone here: a resume is collective (every member must call it) and
                # NCCL refuses one on a partly suspended communicator. Its members decide
                # together in _close_begin; until then no call may reach it.
                self._mark_broken(state, rep, f"its suspend failed part-way: {exc}")

    def _resume(self, state: GroupState, rep: GroupReport) -> None:
        if state.status is Status.BROKEN:
            rep.action, rep.error = Outcome.FAILED, state.error
        elif state.status is not Status.SUSPENDED:  # its suspend failed and was undone
            rep.action, rep.reason = Outcome.KEPT, "its suspend had failed"
        else:
            self._resume_or_break(state, rep)

    def _resume_or_break(self, state: GroupState, rep: GroupReport) -> None:
        try:
            self.backend.resume(state.info.handle)
        except Exception as first:
            memory = self._memory(state)
            if memory is not None and not memory.suspended:
                logger.warning("amem_callbacks: resume of %r reported %s but it is active",
                               state.info.name, first)
            else:
                try:
                    self.backend.resume(state.info.handle)
                except Exception as second:
                    self.counters.add("failures")
                    rep.action = Outcome.FAILED
                    self._mark_broken(state, rep, f"resume failed twice: {first}; {second}")
                    return
        if self.backend.dry_run:
            self.counters.add("would_resumes")
            if rep.action is Outcome.RESUMED:
                rep.action = Outcome.WOULD_RESUME
        else:
            self.counters.add("group_resumes")
        self._mark_active(state)

    def _peer_outcomes(self, work, succeeded: Callable, what: str):
        """Collective over each group's members: share whether this rank's operation
        succeeded ("ok", else "failed", or "part-way" where it left the group broken);
        yield ``(state, report, {failed rank: how}, {member: outcome})`` per group
        (a member that did not report in time has None)."""
        outcomes = self.agreement.exchange(
            {i.state.info.key: (i.state.info.ranks, "ok" if succeeded(i.state) else
                                "part-way" if i.state.status is Status.BROKEN else "failed")
             for i in work})
        for state, rep in ((i.state, i.report) for i in work):
            peers = outcomes.get(state.info.key, {})
            missing = [r for r, v in peers.items() if v is None]
            if missing:  # in the report too: the next call on this group may fail or hang
                rep.reason = (f"rank(s) {missing} did not report {what} it within "
                              f"{self.agreement.timeout_s:g} s (dead or late)")
                if what == "suspending":  # late is likely on a freshly started host
                    rep.reason += ". " + self.suspend_hint()
                logger.warning("amem_callbacks: group %r: %s", state.info.name, rep.reason)
            yield state, rep, {r: v for r, v in peers.items() if v not in ("ok", None)}, peers

    def _close_begin(self, report: TransitionReport, work) -> None:
        """Every member learns how the others' suspends went and all take the same
        state: suspended where all suspended, active where every failure left its
        communicator as it was, else broken everywhere. Never a resume on some members
        only: NCCL's resume waits for every member, and a member whose suspend failed
        part-way cannot resume (mem_manager.cc), so the others would wait forever."""
        for state, rep, failed, peers in self._peer_outcomes(
                work, lambda s: s.status is Status.SUSPENDED, "suspending"):
            mixed = "ok" in peers.values() or "part-way" in failed.values()
            if failed and mixed and state.status is not Status.BROKEN:
                if state.status is not Status.SUSPENDED:  # active here: watched again
                    self._watch_again(state)
                rep.action = Outcome.FAILED
                how = ("part-way" if "part-way" in failed.values()
                       else "while other members suspended it")
                self._mark_broken(state, rep, f"rank(s) {sorted(failed)} failed to suspend it "
                                  f"{how}; NCCL cannot undo that, and a resume here would "
                                  "wait for them forever")
            report.groups.append(rep)

    # --- end -------------------------------------------------------------
    def end(self, report: TransitionReport) -> Submitted:
        """Collective: queue a resume for every group this policy holds suspended,
        the groups agreed as ``first`` before the others (held suspends run first:
        every member of a group must suspend it, NCCL waits for all of them)."""
        self.start_held()
        report.groups.extend(self.auto_resumed)
        self.auto_resumed = []
        states = [s for _k, s in sorted(self.states.items())
                  if not s.resume_queued and s.status in (Status.SUSPENDING, Status.SUSPENDED)]
        work = []
        for state in states:
            state.resume_queued = True
            state.finished = threading.Event()
            work.append(WorkItem(state, _group_report(state.info, Outcome.RESUMED,
                                                      suspendable=state.suspendable,
                                                      path=self.backend.path_of(state.info.handle)),
                                 state.finished))
        must_wait = self._note_gil(report, work)
        report.planned = [item.state.info.name for item in work]
        tiers = [[i for i in work if i.state.first], [i for i in work if not i.state.first]]
        task = self.executor.submit(lambda: self._batch(report, [t for t in tiers if t],
                                                        self._resume, self._close_end),
                                    "end transition")
        return Submitted(task, must_wait)

    def _close_end(self, report: TransitionReport, work) -> None:
        for state, rep, failed, _peers in self._peer_outcomes(
                work, lambda s: s.status is not Status.BROKEN, "resuming"):
            if failed and state.status is not Status.BROKEN:
                # Unusable on a peer: a call here would wait for it forever, so raise instead.
                self._watch_again(state)
                rep.action = Outcome.FAILED
                self._mark_broken(state, rep, f"rank(s) {sorted(failed)} could not resume it")
            report.groups.append(rep)

    # --- state helpers ---------------------------------------------------
    def _memory(self, state: GroupState):
        if state.info.handle is None:
            return None
        try:
            return self.backend.memory(state.info.handle)
        except Exception:
            return None

    def _mark_active(self, state: GroupState) -> None:
        state.status = Status.ACTIVE
        self.states.pop(state.info.key, None)
        for group in state.covers:
            guard.unwatch(group, self)

    def _watch_again(self, state: GroupState) -> None:
        self.states[state.info.key] = state
        if self.guarded:
            for group in state.covers:
                guard.watch(group, self)

    def _mark_broken(self, state: GroupState, rep: GroupReport, why: str) -> None:
        state.status = Status.BROKEN
        state.error = rep.error = why
        logger.error("amem_callbacks: group %r is in an unknown state (%s); calls on it will "
                     "raise. Restart the job.", state.info.name, why)

    def broken(self) -> dict:
        """group key -> why, for the groups broken here: never planned again (a suspend
        of a partly suspended communicator waits in NCCL for members that do not come).
        Every member holds the same set: _close_begin and _close_end break a group on
        all of its members at once."""
        return {key: f"broken since a failed transition ({s.error}); restart the job to use "
                     "it again" for key, s in sorted(list(self.states.items()))
                if s.status is Status.BROKEN}

    def unresumed(self) -> list:
        """Names of the groups held suspended with no resume queued (a phase whose
        body raised leaves them so)."""
        return [s.info.name for _k, s in sorted(list(self.states.items()))
                if not s.resume_queued and s.status in (Status.SUSPENDING, Status.SUSPENDED)]

    def take_guard_resumes(self) -> dict:
        """Group key -> (name, count) of the guard resumes since the last call."""
        taken, self._guard_resumes = self._guard_resumes, {}
        return taken

    def unfinished_groups(self) -> list:
        """Names of the groups whose latest queued operation has not finished."""
        return [s.info.name for _k, s in sorted(self.states.items()) if not s.finished.is_set()]

    def longest_timeout_s(self) -> float:
        """A batch may take as long as its slowest group's c10d timeout."""
        return max((s.timeout_s for s in self.states.values()), default=self.timeout_s or FALLBACK_TIMEOUT_S)

    # --- what a failed begin leaves behind -----------------------------------
    def held_ids(self) -> set:
        """Identities of the group states held now (to tell what a begin adds)."""
        return {id(state) for state in list(self.states.values())}

    def release_unstarted(self, before: set) -> None:
        """Drop the states a failed begin registered (guard included) that no
        worker ever reached: NCCL never saw them, so they are active, and the
        guard would otherwise hold every later call on them until a timeout."""
        for state in list(self.states.values()):
            if id(state) not in before and not state.finished.is_set():
                self._mark_active(state)

    # --- the public view (OffloadPolicy.groups / view) ------------------------
    def views(self, read_nccl: bool = False) -> tuple:
        """A snapshot of every group held, in key order (see :class:`GroupView`)."""
        return tuple(self._view(s, read_nccl) for _k, s in sorted(list(self.states.items())))

    def view_of(self, group, read_nccl: bool = False) -> Optional[GroupView]:
        state = self._state_of(group)
        return None if state is None else self._view(state, read_nccl)

    def _view(self, state: GroupState, read_nccl: bool) -> GroupView:
        memory = self._memory(state) if read_nccl else None
        return GroupView(key=state.info.key, name=state.info.name, ranks=tuple(state.info.ranks),
                         status=state.status,
                         resuming=state.resume_queued and not state.finished.is_set(),
                         suspendable_bytes=state.suspendable,
                         nccl_suspended=None if memory is None else memory.suspended,
                         error=state.error)

    # --- what the guard asks (guard.GroupOwner) ---------------------------
    def _state_of(self, group) -> Optional[GroupState]:
        for state in list(self.states.values()):
            if group in state.covers:
                return state
        return None

    def forget(self, group) -> None:
        """The group is being destroyed: never resume it later."""
        state = self._state_of(group)
        if state is not None:
            state.wait("a pending transition", self.suspend_hint())
        guard.unwatch(group, self)
        if state is not None:
            state.covers = tuple(g for g in state.covers if g is not group)
            if not state.covers:
                self.states.pop(state.info.key, None)

    def before_use(self, group, kind: guard.CallKind, call: str) -> None:
        """Make ``group`` usable before ``call`` runs on it, or raise with the fix."""
        state = self._state_of(group)
        if state is None:
            return
        began = time.monotonic()
        try:
            self._make_usable(state, group, kind, call)
        finally:
            self.counters.record_guard_wait(state.info.name, time.monotonic() - began)

    def _make_usable(self, state: GroupState, group, kind: guard.CallKind, call: str) -> None:
        name = state.info.name
        if state.resume_queued:  # end() or another call already resumes it: just wait
            state.wait(f"{call} waiting for the resume")
            if state.status is Status.BROKEN:
                raise SuspendedGroupError(f"{call}: resuming group {name!r} failed: {state.error}")
            return
        if state.status is Status.BROKEN:
            raise SuspendedGroupError(f"{call} on group {name!r}, whose suspend/resume failed: "
                                      f"{state.error}. Restart the job.")
        if self.strict:
            raise SuspendedGroupError(
                f"{call} on group {name!r} while it is suspended (guard='strict'). Fix: add "
                f"{name!r} to keep=, or call end() first, or use guard='resume'.")
        if kind is guard.CallKind.P2P and len(state.info.ranks) != 2:
            raise SuspendedGroupError(
                f"{call} on suspended group {name!r}: resuming is collective over its "
                f"{len(state.info.ranks)} ranks but a point-to-point call involves two, so it "
                f"cannot be resumed here safely. Fix: add {name!r} to keep= for this phase, "
                "or call end() before point-to-point traffic.")
        if state.info.key == PROCESS_KEY and len(_ranks(group)) != len(state.info.ranks):
            raise SuspendedGroupError(
                f"{call} on a subgroup while backend {self.backend.name!r} has paused the whole "
                "process: only a call on the default group can resume it safely. Fix: call "
                "end() first, or use backend='nccl' and keep this group.")
        self.start_held()  # the call needs the group: suspend (as agreed), then resume it
        state.wait(f"{call} waiting for the suspend", self.suspend_hint())
        if state.status is not Status.SUSPENDED:
            return
        rep = _group_report(state.info, Outcome.RESUMED,
                            f"resumed by the guard: {call} was called on it",
                            suspendable=state.suspendable,
                            path=self.backend.path_of(state.info.handle))
        state.resume_queued = True
        state.finished = done = threading.Event()
        def resume_now():
            self._bind_device()
            self._run_op(self._resume, WorkItem(state, rep, done))

        task = self.executor.submit(resume_now, f"resume of {name!r}")
        task.wait(state.timeout_s)
        self.counters.add("auto_resumes")
        self.auto_resumed.append(rep)
        name_count = self._guard_resumes.get(state.info.key, (name, 0))
        self._guard_resumes[state.info.key] = (name, name_count[1] + 1)
        if name not in self._warned_auto:
            self._warned_auto.add(name)
            logger.warning("amem_callbacks: %s on suspended group %r: resumed it first "
                           "(%.3f s). Keep it active in this phase to avoid the cost.",
                           call, name, rep.seconds)
        if state.status is Status.BROKEN:
            raise SuspendedGroupError(f"{call}: resuming group {name!r} failed: {state.error}")


def _ranks(group) -> list:
    import torch.distributed as dist  # light import: torch at use

    return dist.get_process_group_ranks(group)


def _group_report(info: GroupInfo, action: Outcome, reason: str = "",
                  suspendable: Optional[int] = None, path: str = "") -> GroupReport:
    memory = info.memory
    return GroupReport(
        key=info.key, name=info.name, size=len(info.ranks), action=action, reason=reason,
        suspendable_bytes=suspendable if suspendable is not None else (
            memory.suspendable if memory else None),
        persist_bytes=memory.persist if memory else None,
        unreached_bytes=memory.unreached_bytes if memory else 0,
        unreached_why=memory.unreached_why if memory else "", path=path,
        transport=info.transport)
