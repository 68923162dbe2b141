"""``OffloadPolicy``: suspend idle NCCL groups for a phase, resume them after.

The walk of one ``begin``, top to bottom: the policy checks its phase state,
:mod:`.decide` discovers the groups and runs the agreement rounds (backend and
placement once, the plan every time) and returns an immutable plan,
:class:`~amem_callbacks.transitions.Transitions` queues that plan's suspends
on its worker thread, and the backend calls NCCL through ctypes there
(GIL released). The policy is the one owner of "which phase is active".
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Optional

from . import host_backup
from .backends import select_backend
from .decide import Setup, agree_setup, plan_begin
from .availability import is_cuda_available, is_distributed_initialized
from .errors import OptionError, PhaseError, TransitionError, TransitionTimeout
from .learning import LearnedKeeps
from .log import logger
from .checks import MAX_WAIT_S, WAIT_LIMIT, check_number, check_phase, check_wait
from .options import OffloadOptions, options_from
from .report import Counters, TransitionReport, group_row
from .states import GuardMode, Kind, Outcome
from .transitions import Transitions


#: policies with a transition that may still run when the interpreter exits
_live: "weakref.WeakSet" = weakref.WeakSet()
EXIT_WAIT_S = 30.0


@atexit.register
def _finish_before_exit() -> None:
    """An overlapped end may still be exchanging outcomes over the c10d store
    when the program returns: let it finish (bounded) rather than have the
    interpreter tear down the store under the worker thread (measured on CPU:
    "terminate called without an active exception", an abort at exit)."""
    for policy in list(_live):
        task = policy._pending
        held = policy._transitions is not None and policy._transitions.holding()
        if task is not None and not held:  # held suspends never start at exit
            try:
                task.wait(EXIT_WAIT_S)
            except Exception:  # exiting anyway; the transition's own log says what failed
                pass


class OffloadPolicy:
    """Frees the device memory of idle NCCL communicators during a phase.

    ``begin(phase)`` and ``end(phase)`` are collective: every rank calls them,
    in the same order relative to its other collective calls. Each call is
    bounded in time; no rank waits forever for another.

    Args:
        options: an :class:`~amem_callbacks.OffloadOptions`; or give its
            fields as keyword arguments (``OffloadPolicy(keep=["tp"])``).

    Example:
        >>> policy = OffloadPolicy(keep=["tp"])
        >>> with policy.phase("rollout"):
        ...     outputs = engine.generate(prompts)
    """

    def __init__(self, options: Optional[OffloadOptions] = None, **kwargs):
        self.options = options_from(options, kwargs)
        self._counters = Counters()
        self._last_report: Optional[TransitionReport] = None
        self._learned = LearnedKeeps()
        self._setup: Optional[Setup] = None
        self._transitions: Optional[Transitions] = None
        self._phase: Optional[str] = None
        self._pending = None
        self._warned_not_ready = False
        self._lock = threading.RLock()
        # the latest (number, report) pairs: metrics() shows the last finished
        # begin and end, while a later one may still run (a begin and an end at most)
        self._recent: collections.deque = collections.deque(maxlen=6)
        # before the first communicator: NCCL's runtime must find the hook when it starts
        host_backup.prepare(self.options)
        self._backup_bound = 0  # the most one begin suspended on this rank (bytes)

    # --- public: options, the phase, the views, the figures ------------------
    # Options are read from ``policy.options``. Everything else of the policy
    # is private: RolloutSession, the tools and the tests read the set-up below.
    def groups(self, read_nccl: bool = False) -> tuple:
        """The groups this rank holds suspended, suspending or broken, as
        read-only :class:`~amem_callbacks.GroupView` snapshots in key order
        (empty between phases once every resume finished). Not collective.
        ``read_nccl``: also ask NCCL's own stats whether each is suspended."""
        return () if self._transitions is None else self._transitions.book.views(read_nccl)

    def view(self, group, read_nccl: bool = False):
        """The :class:`~amem_callbacks.GroupView` of one ``ProcessGroup``, or
        None when this policy does not hold it (it is active). Not collective."""
        return None if self._transitions is None else self._transitions.book.view_of(
            group, read_nccl)

    # --- public ----------------------------------------------------------
    def begin(self, phase: str = "rollout", *, hold_s: float = 0.0) -> TransitionReport:
        """Collective over all ranks: suspend the groups ``phase`` leaves idle.

        Called while a phase is active, it does nothing and logs a warning
        naming the open phase (``phase()`` raises instead). Without
        ``init_process_group`` (a single process, or after
        ``destroy_process_group``) it logs once why and does nothing: no phase
        becomes active. If it raises, no phase is active and the message
        names every group this rank still holds.

        Args:
            hold_s: with ``overlap``, agree now but hold this rank's suspends
                until :meth:`start_suspends`, at most this many seconds (or
                until anything needs them over: ``end``, ``wait``, a guarded
                call on a held group). For a caller whose next GPU work must
                not wait: while NCCL pins the host backup of a suspend, the
                process's GPU work stands still, from whichever thread the
                suspend runs (docs/evidence.md). Every rank of a group
                must suspend it before any returns from it, so a rank that
                starts early waits (in the background) for the others.
        """
        check_phase(phase)
        check_number("hold_s", hold_s, minimum=0, maximum=MAX_WAIT_S, why=WAIT_LIMIT)
        with self._lock:
            if self._phase is not None:
                logger.warning("amem_callbacks: begin(%r) while phase %r is active: ignored",
                               phase, self._phase)
                return self._skipped(phase, Kind.BEGIN, f"phase {self._phase!r} is already active")
            if not is_distributed_initialized():
                return self._not_ready(phase)
            self._set_up()
            self._phase = phase
            try:
                return self._begin(phase, hold_s)
            except BaseException as exc:
                self._phase = None
                self._raise_naming_held(f"begin({phase!r})", exc)

    def start_suspends(self) -> bool:
        """Start the suspends a ``begin(hold_s=...)`` holds on this rank, now;
        whether any were held. Not a collective call itself, but every rank that
        holds must come here (or to ``end``, or let ``hold_s`` pass): each suspend
        waits for all members of its group."""
        transitions = self._transitions
        return transitions is not None and transitions.start_held()

    def end(self, phase: Optional[str] = None) -> TransitionReport:
        """Collective over all ranks: resume what ``begin`` suspended.

        ``end`` with no active phase does nothing; ``end`` naming a phase
        other than the active one raises :class:`~amem_callbacks.errors.PhaseError`
        (a ValueError) and leaves that phase open. With ``overlap`` the resumes
        run in the background, the ``resume_first`` groups first. If it raises
        partway, no phase is active and the message names what is still held.
        """
        if phase is not None:
            check_phase(phase)
        with self._lock:
            if self._phase is None:
                logger.debug("amem_callbacks: end(%r) with no active phase: ignored", phase)
                return self._skipped(phase or "", Kind.END, "no phase is active")
            if phase is not None and phase != self._phase:
                raise PhaseError(f"end({phase!r}) but the active phase is {self._phase!r}: "
                                 f"call end({self._phase!r})")
            phase, self._phase = self._phase, None
            if self._transitions is None:
                return self._skipped(phase, Kind.END, self._backend_description)
            try:
                return self._end(phase)
            except BaseException as exc:
                self._raise_naming_held(f"end({phase!r})", exc)

    @contextlib.contextmanager
    def phase(self, name: str = "rollout"):
        """``with policy.phase("rollout"): ...``: begin on entry, end on exit.

        Phases do not nest: entered while a phase is open, it raises
        :class:`~amem_callbacks.errors.PhaseError` at once, naming the open
        phase, and leaves that phase as it was. (A nested block used to be
        ignored at entry and then end the outer phase at its exit.)

        If the body raises, the groups are *not* resumed (that is collective
        and the other ranks may not be here); the guard resumes a group if the
        program uses it again, and the next ``begin`` resumes the rest first.
        """
        check_phase(name)
        with self._lock:
            if self._phase is not None:
                raise PhaseError(
                    f"phase({name!r}) entered while phase {self._phase!r} is open: phases do "
                    f"not nest. Leave the with-block of {self._phase!r} (or call "
                    f"end({self._phase!r})) before entering another; {self._phase!r} is still "
                    "open and untouched")
            report = self.begin(name)
        try:
            yield report
        except BaseException:
            with self._lock:
                if self._phase == name:
                    self._phase = None
            raise
        self.end(name)

    def wait(self, timeout_s: Optional[float] = None) -> Optional[TransitionReport]:
        """Block until an overlapped transition has finished; returns its report."""
        if timeout_s is not None:
            check_wait("timeout_s", timeout_s)
        with self._lock:
            self._wait_pending(timeout_s)
            return self._last_report

    def forget_learned(self, phase: Optional[str] = None) -> None:
        """Drop the learned keep-sets (of one phase, or all): after the model or
        the process groups changed, the next phases learn afresh."""
        self._learned.forget(phase)

    def metrics(self, prefix: str = "amem/", last: bool = True) -> dict:
        """This rank's figures, flat, for a logger called after each phase (the
        same keys every adapter logs):

        - ``amem/total/...``: running totals (begins, ends, group suspends and
          resumes, guard resumes, failures, seconds, device bytes freed);
        - ``amem/learned/<phase>/<group>``: the keeps learned from guard resumes;
        - ``amem/guard_wait/<group>/calls`` and ``.../seconds``: calls the guard
          held back until their group was usable (a resume still running);
        - ``amem/inert``: 1 when no backend works here (training runs unchanged);
        - ``amem/pending``: 1 while a begin or end still runs in the background
          (``overlap``): its figures are not in yet, the previous ones are;
        - with ``last``: the last *finished* begin and the last finished end,
          ``amem/begin/...`` and ``amem/end/...`` (``number``: which begin or end
          they are, 1 for the first; ``groups_suspended``, ``nccl_bytes``,
          ``seconds``, ``group/<name>/...``); in a dry run (noop) also
          ``groups_would_suspend`` / ``groups_would_resume`` and
          ``group/<name>/would_suspend`` / ``would_resume`` per group.

        With ``overlap``, right after a phase its end is usually still running:
        log after the next training step, or call :meth:`wait` first, to see it.
        """
        out = self._counters.as_dict(prefix)
        for phase, groups in self._learned.by_phase().items():
            for name, count in groups.items():
                out[f"{prefix}learned/{phase}/{name}"] = count
        out[prefix + "inert"] = int(self._inert)
        if self.options.reuse_host_backup and not self._inert and \
                host_backup.applies_to(self._backend):
            out.update(host_backup.metrics(prefix))
        out[prefix + "pending"] = int(any(report.pending for _n, report in self._recent))
        if last:
            for kind in (Kind.BEGIN, Kind.END):
                found = self._last_finished(kind)
                if found is not None:
                    out.update(self._figures(*found, prefix))
        return out

    def close(self) -> None:
        """End an active phase (collective), wait for pending work, and unpin the host
        backup kept for the next suspend."""
        if self._phase is not None:
            self.end()
        self.wait()
        host_backup.release()

    # --- internals -------------------------------------------------------
    # What the first begin set up (None, "" or False before it). The figures
    # users read are in metrics() ("amem/inert") and the reports (``backend``,
    # ``skipped``: why nothing was done).
    @property
    def _backend(self):
        return self._setup.backend if self._setup is not None else None

    @property
    def _backend_description(self) -> str:
        return self._setup.description if self._setup is not None else ""

    @property
    def _inert(self) -> bool:
        """True once the ranks agreed that nothing can be freed here."""
        return self._setup is not None and self._setup.inert

    @property
    def _placement(self):
        return self._setup.placement if self._setup is not None else None

    @property
    def _agreement(self):
        """The store agreement of this policy's set-up (None before the first begin)."""
        return self._setup.agreement if self._setup is not None else None

    def _wait_for_bytes(self, nbytes: Optional[int], timeout_s: Optional[float]) -> int:
        """Block until the running begin has freed ``nbytes`` on this rank (None:
        all it will free) or has finished; the bytes freed so far (0: none ran).
        Arguments are checked by the caller (:meth:`RolloutSession.wait_for_memory`)."""
        if self._transitions is None:
            return 0
        if nbytes is None:
            self.wait(timeout_s)
            return self._transitions.wait_for_bytes(0, timeout_s or 1.0)
        return self._transitions.wait_for_bytes(nbytes, self._timeout(timeout_s))

    def _new_report(self, phase: str, kind: Kind) -> TransitionReport:
        return TransitionReport(phase=phase, kind=kind, backend=self._backend.name,
                                started=time.monotonic(), pending=True,
                                device_shared_by=self._placement.sharing_my_device(),
                                learned=self._learned.by_phase().get(phase, {}))

    def _begin(self, phase: str, hold_s: float = 0.0) -> TransitionReport:
        """The begin of an open phase; whatever it raises, the caller closes the phase."""
        if self._inert:
            return self._skipped(phase, Kind.BEGIN, self._backend_description)
        self._wait_pending()
        self._resume_left_behind(phase)
        self._counters.add("begins")
        report = self._new_report(phase, Kind.BEGIN)
        report.hold_s = hold_s
        plan = plan_begin(self._setup, self.options, phase,
                          {**self._learned.reasons(phase), **self._transitions.book.broken()})
        if self.options.reuse_host_backup:
            planned = sum(s.nbytes or 0 for s in plan.suspend)
            self._backup_bound = max(self._backup_bound, planned)
            host_backup.bound(self._backup_bound)
        # what the plan fixes is in the report before anything runs; the batch's
        # rows come back once, to _finish, on the worker
        report.agree_seconds = plan.agree_seconds
        report.groups = [group_row(info, Outcome.KEPT, reason) for info, reason in plan.kept]
        book = self._transitions.book
        before = book.held_ids()
        submitted = None
        try:
            submitted = self._transitions.begin(plan, hold_s,
                                                lambda result: self._finish(report, result))
            return self._run(submitted, report, self._counters.begins)
        except BaseException:
            if submitted is None or submitted.task.done():  # nothing will run them now
                book.release_unstarted(before)
            raise

    def _end(self, phase: str) -> TransitionReport:
        self._counters.add("ends")
        resumed = self._transitions.owner.take_counts()
        if self.options.learn_keep and resumed:
            self._learned.note(phase, resumed)
        report = self._queue_end(phase)
        if GuardMode(self.options.guard) is GuardMode.OFF:
            self._wait_pending()  # nothing else holds a call back until its group is back
        return report

    # --- what a failed begin or end leaves behind --------------------------
    def _resume_left_behind(self, phase: str) -> None:
        """Collective: resume what a phase whose body raised left suspended, before
        this begin plans (it would plan to suspend them again). Every rank that
        left that phase so resumes them here; a rank that ended it normally is
        already waiting in those same resumes. Guard resumes since then are
        dropped, not learned: that phase never ended."""
        left = self._transitions.book.unresumed()
        if not left:
            return
        logger.warning("amem_callbacks: begin(%r): %s stayed suspended after the last phase "
                       "raised; resuming them first", phase, left)
        self._transitions.owner.take_counts()
        self._counters.add("ends")
        self._queue_end(phase)
        self._wait_pending()

    def _queue_end(self, phase: str) -> TransitionReport:
        """An end's report, its guard-resume rows in it before the resumes are queued."""
        report = self._new_report(phase, Kind.END)
        report.groups = list(self._transitions.owner.take_rows())
        submitted = self._transitions.end(lambda result: self._finish(report, result))
        return self._run(submitted, report, self._counters.ends)

    def _finish(self, report: TransitionReport, result) -> TransitionReport:
        """On the worker, once a batch has run: its rows and readings into ``report``,
        the policy's figures from them; the report is done (``pending`` False)."""
        report.groups = sorted([*report.groups, *result.rows], key=lambda g: g.key)
        report.device_free_before, report.device_free_after = (result.device_free_before,
                                                               result.device_free_after)
        report.host_rss_before, report.host_rss_after = (result.host_rss_before,
                                                         result.host_rss_after)
        if result.held_until is not None:
            report.held_seconds = result.held_until - report.started
        moved = [g for g in report.groups if g.action in (
            Outcome.SUSPENDED, Outcome.RESUMED, Outcome.WOULD_SUSPEND, Outcome.WOULD_RESUME,
            Outcome.FAILED)]
        report.total_seconds = report.agree_seconds + sum(g.seconds for g in moved)
        report.wall_seconds = time.monotonic() - report.started
        self._counters.add("transition_seconds", report.total_seconds)
        # On a shared GPU the reading is the whole device's, not this rank's: not counted.
        if (report.kind is Kind.BEGIN and report.device_freed_bytes is not None
                and report.device_shared_by <= 1):
            self._counters.record_freed(report.device_freed_bytes)
        report.pending = False
        logger.info("amem_callbacks: %s", report.summary())
        return report

    def _held_names(self) -> list:
        return [f"{view.name!r} ({view.status}{', resuming' if view.resuming else ''})"
                for view in self.groups()]

    def _raise_naming_held(self, what: str, exc: BaseException):
        """Re-raise what a begin or end raised (its phase is closed already), its
        message naming every group this rank still holds: those stay suspended
        and guarded, the guard resumes each before its next call."""
        held = self._held_names()
        if not held:
            raise exc
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: never replaced
            logger.error("amem_callbacks: %s interrupted; no phase is active; this rank still "
                         "holds %s", what, ", ".join(held))
            raise exc
        cls = TransitionTimeout if isinstance(exc, TransitionTimeout) else TransitionError
        raise cls(f"{what} failed: {exc} No phase is active; this rank still holds "
                  f"{', '.join(held)}: the guard resumes each before its next call "
                  "(guard='resume'); after a timeout, stop the job.") from exc

    # --- what metrics() reads ------------------------------------------------
    def _last_finished(self, kind: Kind):
        for number, report in reversed(self._recent):
            if report.kind is kind and not report.pending:
                return number, report
        return None

    def _figures(self, number: int, report: TransitionReport, prefix: str) -> dict:
        """One finished report's figures; a dry run also says per group what it
        would have done (the report counts only what it did: nothing)."""
        out = report.as_dict(prefix)
        p = f"{prefix}{report.kind}/"
        out[p + "number"] = number
        if getattr(self._backend, "dry_run", False):
            would = Outcome.WOULD_SUSPEND if report.kind is Kind.BEGIN else Outcome.WOULD_RESUME
            word = str(would).replace(" ", "_")
            names = [g.name for g in report.groups if g.action == would]
            out[f"{p}groups_{word}"] = len(names)
            for name in names:
                out[f"{p}group/{name}/{word}"] = 1
        return out

    def _run(self, submitted, report: TransitionReport, number: int) -> TransitionReport:
        report.planned = list(submitted.planned)
        report.gil_held = submitted.must_wait
        self._last_report = report
        self._recent.append((number, report))
        self._pending = submitted.task
        _live.add(self)
        if not self.options.overlap or submitted.must_wait:
            self._wait_pending()
        return report

    def _wait_pending(self, timeout_s: Optional[float] = None) -> None:
        task, self._pending = self._pending, None
        if task is None:
            return
        self._transitions.start_held()  # waiting for a held begin is needing it
        try:
            task.wait(self._timeout(timeout_s))
        except TransitionTimeout as exc:
            stuck = self._transitions.book.unfinished_groups()
            raise TransitionTimeout(f"{exc} Groups not finished on this rank: {stuck}.") from None

    def _timeout(self, timeout_s: Optional[float]) -> float:
        """The wait for a transition: the caller's, the option, else the slowest
        group's c10d timeout, which may exceed the longest wait a lock takes."""
        chosen = (timeout_s or self.options.timeout_s
                  or self._transitions.book.longest_timeout_s())
        return min(chosen, MAX_WAIT_S)

    def _skipped(self, phase: str, kind: Kind, why: str) -> TransitionReport:
        report = TransitionReport(phase=phase, kind=kind,
                                  backend=getattr(self._backend, "name", "none"), skipped=why)
        self._last_report = report
        return report

    def _not_ready(self, phase: str) -> TransitionReport:
        level, why = self._why_not_ready()
        if not self._warned_not_ready:
            self._warned_not_ready = True
            logger.log(level, "amem_callbacks: begin(%r): %s", phase, why)
        return self._skipped(phase, Kind.BEGIN, why)

    def _why_not_ready(self) -> tuple:
        """(log level, why) without torch.distributed: advice that fits how the
        job was started. A single process (TRL or accelerate on one device, a
        notebook) has no NCCL communicator at all: nothing to fix there."""
        if self._setup is not None:
            return logging.WARNING, (
                "torch.distributed was shut down (destroy_process_group) after this policy's "
                "first begin; nothing was suspended and no phase is active")
        world = os.environ.get("WORLD_SIZE", "")
        if world.isdigit() and int(world) > 1:
            return logging.WARNING, (
                f"torch.distributed is not initialized in this process of a {world}-process "
                "job (WORLD_SIZE): call init_process_group before begin(); nothing was "
                "suspended and no phase is active")
        return logging.INFO, (
            "a single process (torch.distributed is not initialized, WORLD_SIZE unset or 1) "
            "has no NCCL communicator to free: nothing is suspended, training runs unchanged")

    def _set_up(self) -> None:
        """First begin on this rank (or the first after the default group was
        replaced): pick a backend and make all ranks agree on it."""
        from torch.distributed import distributed_c10d as c10d  # light import: torch at use

        if self._setup is not None and self._setup.default_group is c10d._get_default_group():
            return
        if self._setup is not None:
            logger.info("amem_callbacks: the default process group was re-created; "
                        "setting up again")
        self._check_device()  # before any agreement: nothing is set up if it fails
        self._pending = None
        self._setup = agree_setup(self.options, select_backend)
        if not self._setup.inert:
            host_backup.prepare(self.options, self._setup.backend)
            host_backup.tell_once(self.options, self._setup.backend)
        self._transitions = None if self._setup.inert else Transitions(
            self._setup, self.options, self._counters)

    def _check_device(self) -> None:
        """``device`` against the CUDA devices this process sees (construction
        cannot ask: it imports no torch). Worker threads bind it before any call."""
        device = self.options.device
        if device is None:
            return
        import torch  # light import: torch at use

        count = torch.cuda.device_count() if is_cuda_available() else 0
        if device >= count:
            fix = (f"write 0 to {count - 1}, or leave device unset (the current device)"
                   if count else "leave device unset: this process sees no CUDA device")
            raise OptionError(f"device={device}, but this process sees {count} CUDA "
                              f"device(s): {fix}")


class PolicySeam:
    """What a :class:`~amem_callbacks.RolloutSession` reads of its policy, and all of
    it: the one internal interface between the two (the session never touches the
    policy's private state; the policy's public surface stays its verbs)."""

    __slots__ = ("_policy",)

    def __init__(self, policy: OffloadPolicy):
        self._policy = policy

    @property
    def phase_open(self) -> bool:
        return self._policy._phase is not None

    @property
    def set_up(self) -> bool:
        """The first begin has agreed the set-up (before it, a session shows nothing)."""
        return self._policy._setup is not None

    @property
    def backend_name(self) -> str:
        return getattr(self._policy._backend, "name", "none")

    @property
    def dry_run(self) -> bool:
        """The backend frees nothing (noop): a session counts nothing as freed."""
        return bool(getattr(self._policy._backend, "dry_run", False))

    def share(self, name: str, value: str, ranks=None) -> tuple:
        """The set-up's store agreement (``Agreement.share``) over ``ranks`` (None:
        every rank); ``({}, [])`` before the set-up or without an agreement."""
        agreement = self._policy._agreement
        if agreement is None:
            return {}, []
        if ranks is None:
            import torch.distributed as dist  # light import: torch at use

            ranks = range(dist.get_world_size())
        return agreement.share(name, value, ranks)

    def sharing_my_device(self) -> int:
        placement = self._policy._placement
        return max(1, placement.sharing_my_device()) if placement is not None else 1

    def wait_for_bytes(self, nbytes: Optional[int], timeout_s: Optional[float]) -> int:
        return self._policy._wait_for_bytes(nbytes, timeout_s)

