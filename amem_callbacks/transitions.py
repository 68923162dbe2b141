"""The suspend and resume batches of one policy, and what the guard asks of them.

Every NCCL call runs on one serial worker thread in the order it was submitted.
Submissions happen in the same program order on every rank (group keys sorted,
batches in begin/end order, guard resumes where the program calls the group),
so the collective calls of all ranks line up without any extra coordination.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from . import guard
from .agreement import Agreement, is_yes, reason_of, vote_no, vote_yes
from .errors import SuspendedGroupError
from .executor import SerialExecutor, Task
from .groups import GroupInfo
from .memory import device_free_bytes, host_rss_bytes
from .plan import SUSPEND
from .report import (FAILED, KEPT, RESUMED, SUSPENDED, WOULD_RESUME, WOULD_SUSPEND, Counters,
                     GroupReport, TransitionReport)

logger = logging.getLogger("amem_callbacks")

ACTIVE = "active"
SUSPENDING = "suspending"
SUSPENDED_STATE = "suspended"
RESUMING = "resuming"
BROKEN = "broken"

PROCESS_KEY = "__process__"


@dataclass
class GroupState:
    info: GroupInfo
    status: str
    report: GroupReport
    timeout_s: float
    task: Optional[Task] = None
    #: every process group whose calls depend on this state (several for AMem)
    covers: tuple = ()


def group_timeout_s(group, default_s: float) -> float:
    """The c10d timeout of a group's NCCL backend, else ``default_s``."""
    try:
        import torch

        backend = group._get_backend(torch.device("cuda"))
        return backend.options._timeout.total_seconds()
    except Exception:
        return default_s


class Transitions:
    def __init__(self, backend, agreement: Agreement, device: Optional[int],
                 timeout_s: Optional[float], counters: Counters):
        self.backend = backend
        self.agreement = agreement
        self.device = device
        self.timeout_s = timeout_s
        self.counters = counters
        self.executor = SerialExecutor()
        self.states: dict = {}  # key -> GroupState, for groups not known to be active
        self.auto_resumed: list = []  # GroupReports of guard resumes since the last end()
        self._warned_auto: set = set()
        self.strict = False  # guard='strict': raise instead of resuming

    # --- begin -----------------------------------------------------------
    def begin(self, report: TransitionReport, groups, plan) -> Task:
        """Collective: agree, then submit the suspends and the closing step."""
        world = tuple(range(self.agreement_world()))
        proposals = {g.key: (g.ranks, vote_yes(self.backend.name) if d.action == SUSPEND
                             else vote_no(d.reason)) for g, d in zip(groups, plan)}
        if self.backend.process_wide:
            proposals = {PROCESS_KEY: (world, _process_vote(groups, plan, self.backend.name))}
        start = time.monotonic()
        agreed = self.agreement.decide(proposals)
        report.agree_seconds = time.monotonic() - start

        chosen = []
        for g, d in zip(groups, plan):
            value = agreed.get(PROCESS_KEY if self.backend.process_wide else g.key)
            if is_yes(value) and d.action == SUSPEND:
                chosen.append(g)
            elif d.action == SUSPEND and not self.backend.process_wide:
                report.groups.append(_group_report(g, KEPT, "a peer rank refused: " + reason_of(value)))
            else:
                reason = d.reason if d.action != SUSPEND else reason_of(value)
                report.groups.append(_group_report(g, KEPT, reason))

        states = self._new_states(chosen, groups, world)
        measure = self.executor.submit(lambda: self._measure(report, "before"), "measure")
        for state in states:
            state.task = self.executor.submit(lambda s=state: self._suspend(s),
                                              f"suspend of group {state.info.name!r}")
        return self.executor.submit(lambda: self._close_begin(report, states, measure),
                                    "closing the begin transition")

    def agreement_world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def _new_states(self, chosen, groups, world) -> list:
        if not chosen:
            return []
        if self.backend.process_wide:
            world_group = next(g for g in groups if len(g.ranks) == len(world))
            info = GroupInfo(group=world_group.group, key=PROCESS_KEY, name="process",
                             ranks=world, handle=None)
            covers = tuple(g.group for g in chosen)
            chosen_infos = [(info, covers)]
        else:
            chosen_infos = [(g, (g.group,)) for g in chosen]
        states = []
        for info, covers in chosen_infos:
            rep = _group_report(info, SUSPENDED)
            if info.key == PROCESS_KEY:
                rep.suspendable_bytes = sum((g.memory.suspendable if g.memory else 0) for g in chosen)
            state = GroupState(info=info, status=SUSPENDING, report=rep, covers=covers,
                               timeout_s=self.timeout_s or group_timeout_s(info.group, 1800.0))
            self.states[info.key] = state
            for group in covers:
                guard.watch(group, self)
            states.append(state)
        return states

    def _measure(self, report: TransitionReport, when: str) -> None:
        setattr(report, f"device_free_{when}", device_free_bytes(self.device))
        setattr(report, f"host_rss_{when}", host_rss_bytes())

    def _suspend(self, state: GroupState) -> None:
        start = time.monotonic()
        try:
            self.backend.suspend(state.info.handle)
            state.status = SUSPENDED_STATE
            state.report.action = WOULD_SUSPEND if self.backend.dry_run else SUSPENDED
            self.counters.group_suspends += 1
        except Exception as exc:
            state.report.action = FAILED
            state.report.error = str(exc)
            self.counters.failures += 1
            self._settle_after_failed_suspend(state)
            logger.error("amem_callbacks: suspending group %r failed, it stays active: %s",
                         state.info.name, exc)
        state.report.seconds = time.monotonic() - start

    def _settle_after_failed_suspend(self, state: GroupState) -> None:
        memory = self._memory(state)
        if memory is not None and memory.suspended:
            try:
                self.backend.resume(state.info.handle)
            except Exception as exc:
                self._mark_broken(state, f"half-suspended and resume failed: {exc}")
                return
        self._mark_active(state)

    def _close_begin(self, report: TransitionReport, states, measure: Task) -> TransitionReport:
        outcomes = self.agreement.exchange(
            {s.info.key: (s.info.ranks, "ok" if s.status == SUSPENDED_STATE else "failed")
             for s in states})
        for state in states:
            peers = outcomes.get(state.info.key, {})
            failed = [r for r, v in peers.items() if v == "failed"]
            missing = [r for r, v in peers.items() if v is None]
            if failed and state.status == SUSPENDED_STATE:
                # Ranks must agree on the state: undo ours so the group is active everywhere.
                self._resume_inline(state)
                state.report.action = FAILED
                state.report.reason = f"rank(s) {failed} failed to suspend it; resumed here too"
            elif missing:
                logger.warning("amem_callbacks: rank(s) %s did not report on group %r within "
                               "%g s", missing, state.info.name, self.agreement.timeout_s)
            report.groups.append(state.report)
        report.groups.sort(key=lambda g: g.key)
        self._measure(report, "after")
        return self._finish(report, measure)

    # --- end -------------------------------------------------------------
    def end(self, report: TransitionReport) -> Task:
        """Collective: submit a resume for every group this policy holds suspended."""
        report.groups.extend(self.auto_resumed)
        self.auto_resumed = []
        states = [s for _k, s in sorted(self.states.items()) if s.status in (SUSPENDING, SUSPENDED_STATE)]
        measure = self.executor.submit(lambda: self._measure(report, "before"), "measure")
        for state in states:
            state.report = _group_report(state.info, RESUMED, suspendable=state.report.suspendable_bytes)
            state.task = self.executor.submit(lambda s=state: self._resume(s),
                                              f"resume of group {state.info.name!r}")
        return self.executor.submit(lambda: self._close_end(report, states, measure),
                                    "closing the end transition")

    def _resume(self, state: GroupState) -> None:
        if state.status == BROKEN:
            state.report.action = FAILED
            return
        if state.status != SUSPENDED_STATE:  # its suspend failed and was undone
            state.report.action = KEPT
            state.report.reason = "its suspend had failed"
            return
        state.status = RESUMING
        start = time.monotonic()
        self._resume_inline(state)
        state.report.seconds = time.monotonic() - start

    def _resume_inline(self, state: GroupState) -> None:
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
                    self.counters.failures += 1
                    state.report.action = FAILED
                    state.report.error = str(second)
                    self._mark_broken(state, f"resume failed twice: {first}; {second}")
                    return
        self.counters.group_resumes += 1
        if self.backend.dry_run and state.report.action == RESUMED:
            state.report.action = WOULD_RESUME
        self._mark_active(state)

    def _close_end(self, report: TransitionReport, states, measure: Task) -> TransitionReport:
        outcomes = self.agreement.exchange(
            {s.info.key: (s.info.ranks, "failed" if s.status == BROKEN else "ok") for s in states})
        for state in states:
            peers = outcomes.get(state.info.key, {})
            failed = [r for r, v in peers.items() if v == "failed"]
            missing = [r for r, v in peers.items() if v is None]
            if failed and state.status != BROKEN:
                # Unusable on a peer: a call here would wait for it forever, so raise instead.
                self._watch_again(state)
                state.report.action = FAILED
                self._mark_broken(state, f"rank(s) {failed} could not resume it")
            elif missing:
                logger.warning("amem_callbacks: rank(s) %s did not report resuming group %r "
                               "within %g s", missing, state.info.name, self.agreement.timeout_s)
            report.groups.append(state.report)
        report.groups.sort(key=lambda g: g.key)
        self._measure(report, "after")
        return self._finish(report, measure)

    def _finish(self, report: TransitionReport, measure: Task) -> TransitionReport:
        measure.wait(0)
        moved = [g for g in report.groups if g.action in (SUSPENDED, RESUMED, WOULD_SUSPEND,
                                                          WOULD_RESUME, FAILED)]
        report.total_seconds = report.agree_seconds + sum(g.seconds for g in moved)
        self.counters.transition_seconds += report.total_seconds
        if report.kind == "begin" and report.device_freed_bytes is not None:
            self.counters.last_device_freed_bytes = report.device_freed_bytes
            self.counters.max_device_freed_bytes = max(self.counters.max_device_freed_bytes,
                                                       report.device_freed_bytes)
        report.pending = False
        report.wall_seconds = time.monotonic() - report.started
        logger.info("amem_callbacks: %s", report.summary())
        return report

    # --- state helpers ---------------------------------------------------
    def _memory(self, state: GroupState):
        if state.info.handle is None:
            return None
        try:
            return self.backend.memory(state.info.handle)
        except Exception:
            return None

    def _mark_active(self, state: GroupState) -> None:
        state.status = ACTIVE
        self.states.pop(state.info.key, None)
        for group in state.covers:
            guard.unwatch(group)

    def _watch_again(self, state: GroupState) -> None:
        self.states[state.info.key] = state
        for group in state.covers:
            guard.watch(group, self)

    def _mark_broken(self, state: GroupState, why: str) -> None:
        state.status = BROKEN
        state.report.error = why
        logger.error("amem_callbacks: group %r is in an unknown state (%s); calls on it will "
                     "raise. Restart the job.", state.info.name, why)

    def wait_idle(self, timeout_s: float) -> None:
        """Block until every submitted transition has run (raises on timeout)."""
        self.executor.submit(lambda: None, "waiting for pending transitions").wait(timeout_s)

    # --- what the guard asks ---------------------------------------------
    def _state_of(self, group) -> Optional[GroupState]:
        for state in list(self.states.values()):
            if group in state.covers:
                return state
        return None

    def _forget(self, group) -> None:
        """The group is being destroyed: never resume it later."""
        state = self._state_of(group)
        if state is not None and state.task is not None:
            state.task.wait(state.timeout_s)
        guard.unwatch(group)
        if state is not None:
            state.covers = tuple(g for g in state.covers if g is not group)
            if not state.covers:
                self.states.pop(state.info.key, None)

    def _before_use(self, group, kind: str, call: str) -> None:
        """Make ``group`` usable before ``call`` runs on it, or raise with the fix."""
        state = self._state_of(group)
        if state is None:
            return
        if state.status == RESUMING and state.task is not None:
            state.task.wait(state.timeout_s)  # end() already resumes it: just wait
            if state.status == ACTIVE:
                return
        name = state.info.name
        if state.status == BROKEN:
            raise SuspendedGroupError(f"{call} on group {name!r}, whose suspend/resume failed: "
                                      f"{state.report.error}. Restart the job.")
        if self.strict:
            raise SuspendedGroupError(
                f"{call} on group {name!r} while it is suspended (guard='strict'). Fix: add "
                f"{name!r} to keep=, or call end() first, or use guard='resume'.")
        if kind == "p2p" and len(state.info.ranks) != 2:
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
        if state.task is not None and not state.task.done():
            state.task.wait(state.timeout_s)
        if state.status != SUSPENDED_STATE:
            return
        state.report = _group_report(state.info, RESUMED, "resumed by the guard: "
                                     f"{call} was called on it",
                                     suspendable=state.report.suspendable_bytes)
        state.task = self.executor.submit(lambda: self._resume(state), f"resume of {name!r}")
        state.task.wait(state.timeout_s)
        self.counters.auto_resumes += 1
        self.auto_resumed.append(state.report)
        if name not in self._warned_auto:
            self._warned_auto.add(name)
            logger.warning("amem_callbacks: %s on suspended group %r: resumed it first "
                           "(%.3f s). Keep it active in this phase to avoid the cost.",
                           call, name, state.report.seconds)
        if state.status == BROKEN:
            raise SuspendedGroupError(f"{call}: resuming group {name!r} failed: "
                                      f"{state.report.error}")


def _ranks(group) -> list:
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)


def _process_vote(groups, plan, backend_name: str) -> str:
    """A process-wide backend pauses all or nothing: one vote for the whole process."""
    if any(d.action == SUSPEND for d in plan):
        return vote_yes(backend_name)
    reasons = [d.reason for g, d in zip(groups, plan) if g.handle is not None]
    return vote_no(reasons[0] if reasons else "no communicator to pause")


def _group_report(info: GroupInfo, action: str, reason: str = "",
                  suspendable: Optional[int] = None) -> GroupReport:
    memory = info.memory
    return GroupReport(
        key=info.key, name=info.name, size=len(info.ranks), action=action, reason=reason,
        suspendable_bytes=suspendable if suspendable is not None else (
            memory.suspendable if memory else None),
        persist_bytes=memory.persist if memory else None)
