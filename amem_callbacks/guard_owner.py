"""What the guard asks of a policy (guard.GroupOwner): before a call on a group the
policy holds, make the group usable (wait for its queued resume, or resume it now,
or raise with the fix); when a group is destroyed, forget it.

A guard resume is queued on the policy's serial worker like any batch (so its NCCL
call lines up with every rank's), and its row is kept for the next ``end``'s report.
"""

from __future__ import annotations

import threading
import time

from . import guard
from .decide import PROCESS_KEY
from .errors import SuspendedGroupError
from .group_book import GroupBook, GroupState
from .log import logger
from .states import Outcome, Status


class GuardOwner:
    """The guard's owner of every group in ``book``; ``batches`` (transitions.py)
    runs its resumes. ``strict``: raise instead of resuming."""

    def __init__(self, book: GroupBook, batches, counters, strict: bool):
        self.book = book
        self.batches = batches
        self.counters = counters
        self.strict = strict
        self.resumed_rows: list = []  # GroupReports of guard resumes since the last end()
        self._counts: dict = {}  # group key -> (name, count) since the last end()
        self._warned: set = set()
        book.owner = self

    def take_rows(self) -> tuple:
        """The guard resumes' rows since the last call (the next end reports them)."""
        rows, self.resumed_rows = tuple(self.resumed_rows), []
        return rows

    def take_counts(self) -> dict:
        """Group key -> (name, count) of the guard resumes since the last call."""
        taken, self._counts = self._counts, {}
        return taken

    # --- guard.GroupOwner -----------------------------------------------------
    def forget(self, group) -> None:
        """The group is being destroyed: never resume it later."""
        state = self.book.state_of(group)
        if state is not None:
            state.wait("a pending transition", self.batches.suspend_hint())
            self.book.forget(state, group)
        else:
            guard.unwatch(group, self)

    def before_use(self, group, kind: guard.CallKind, call: str) -> None:
        """Make ``group`` usable before ``call`` runs on it, or raise with the fix."""
        state = self.book.state_of(group)
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
                f"{call} on a subgroup while backend {self.book.backend.name!r} has paused the "
                "whole process: only a call on the default group can resume it safely. Fix: "
                "call end() first, or use backend='nccl' and keep this group.")
        self.batches.start_held()  # the call needs the group: suspend (as agreed), resume it
        state.wait(f"{call} waiting for the suspend", self.batches.suspend_hint())
        if state.status is not Status.SUSPENDED:
            return
        row = self.batches.row(state, Outcome.RESUMED,
                               f"resumed by the guard: {call} was called on it")
        state.resume_queued = True
        state.finished = done = threading.Event()
        outcome = []

        def resume_now():
            self.batches.bind_device()
            outcome.append(self.batches.run_op(self.batches.resume_one, state, done))

        task = self.batches.executor.submit(resume_now, f"resume of {name!r}")
        task.wait(state.timeout_s)
        self.counters.add("auto_resumes")
        row = outcome[0].on(row) if outcome else row
        self.resumed_rows.append(row)
        self._counts[state.info.key] = (name, self._counts.get(state.info.key, (name, 0))[1] + 1)
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("amem_callbacks: %s on suspended group %r: resumed it first "
                           "(%.3f s). Keep it active in this phase to avoid the cost.",
                           call, name, row.seconds)
        if state.status is Status.BROKEN:
            raise SuspendedGroupError(f"{call}: resuming group {name!r} failed: {state.error}")


def _ranks(group) -> list:
    import torch.distributed as dist  # light import: torch at use

    return dist.get_process_group_ranks(group)
