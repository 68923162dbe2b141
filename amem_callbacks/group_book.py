"""The groups a policy holds (suspending, suspended, broken): their state, and the
read-only views of them (``OffloadPolicy.groups``/``view``).

One book per policy. The batches (transitions.py) write a state's ``status`` from
their worker; ``end`` and the guard (guard_owner.py) queue resumes on it; everything
else here only reads. A group the book does not hold is active.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from . import guard
from .decide import PROCESS_KEY, AgreedPlan
from .errors import TransitionTimeout
from .groups import GroupInfo
from .log import logger
from .report import GroupView
from .states import Status

#: where a group's own c10d timeout cannot be read: torch's default for a process
#: group (30 min), the bound a collective on that group would have had anyway
FALLBACK_TIMEOUT_S = 1800.0
_warned_timeout: list = []


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


class GroupBook:
    """Every group state held, by key; ``owner`` (the guard's, guard.GroupOwner) is
    who the guard asks before a call on a held group."""

    def __init__(self, backend, timeout_s: Optional[float], guarded: bool):
        self.backend = backend
        self.timeout_s = timeout_s
        self.guarded = guarded  # guard='off': calls are not intercepted
        self.owner = None  # set by the guard's owner when it is made
        self.states: dict = {}  # key -> GroupState, for groups not known to be active

    # --- taking groups in and out ------------------------------------------
    def take(self, plan: AgreedPlan) -> list:
        """A state for every group the plan suspends, watched by the guard."""
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
                    guard.watch(group, self.owner)
            states.append(state)
        return states

    def mark_active(self, state: GroupState) -> None:
        state.status = Status.ACTIVE
        self.states.pop(state.info.key, None)
        for group in state.covers:
            guard.unwatch(group, self.owner)

    def watch_again(self, state: GroupState) -> None:
        self.states[state.info.key] = state
        if self.guarded:
            for group in state.covers:
                guard.watch(group, self.owner)

    def mark_broken(self, state: GroupState, why: str) -> None:
        state.status = Status.BROKEN
        state.error = why
        logger.error("amem_callbacks: group %r is in an unknown state (%s); calls on it will "
                     "raise. Restart the job.", state.info.name, why)

    def forget(self, state: GroupState, group) -> None:
        """``group`` is being destroyed: it no longer depends on ``state``."""
        guard.unwatch(group, self.owner)
        state.covers = tuple(g for g in state.covers if g is not group)
        if not state.covers:
            self.states.pop(state.info.key, None)

    # --- reading ------------------------------------------------------------
    def state_of(self, group) -> Optional[GroupState]:
        for state in list(self.states.values()):
            if group in state.covers:
                return state
        return None

    def memory(self, state: GroupState):
        """NCCL's own account of the group's memory, or None where it cannot be read."""
        if state.info.handle is None:
            return None
        try:
            return self.backend.memory(state.info.handle)
        except Exception:
            return None

    def to_resume(self) -> list:
        """The states a resume must be queued for, in key order."""
        return [s for _k, s in sorted(self.states.items())
                if not s.resume_queued and s.status in (Status.SUSPENDING, Status.SUSPENDED)]

    def broken(self) -> dict:
        """group key -> why, for the groups broken here: never planned again (a suspend
        of a partly suspended communicator waits in NCCL for members that do not come).
        Every member holds the same set: a batch breaks a group on all of its members
        at once."""
        return {key: f"broken since a failed transition ({s.error}); restart the job to use "
                     "it again" for key, s in sorted(list(self.states.items()))
                if s.status is Status.BROKEN}

    def unresumed(self) -> list:
        """Names of the groups held suspended with no resume queued (a phase whose
        body raised leaves them so)."""
        return [s.info.name for _k, s in sorted(list(self.states.items()))
                if not s.resume_queued and s.status in (Status.SUSPENDING, Status.SUSPENDED)]

    def unfinished_groups(self) -> list:
        """Names of the groups whose latest queued operation has not finished."""
        return [s.info.name for _k, s in sorted(self.states.items()) if not s.finished.is_set()]

    def longest_timeout_s(self) -> float:
        """A batch may take as long as its slowest group's c10d timeout."""
        return max((s.timeout_s for s in self.states.values()),
                   default=self.timeout_s or FALLBACK_TIMEOUT_S)

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
                self.mark_active(state)

    # --- the public view (OffloadPolicy.groups / view) ------------------------
    def views(self, read_nccl: bool = False) -> tuple:
        """A snapshot of every group held, in key order (see :class:`GroupView`)."""
        return tuple(self._view(s, read_nccl) for _k, s in sorted(list(self.states.items())))

    def view_of(self, group, read_nccl: bool = False) -> Optional[GroupView]:
        state = self.state_of(group)
        return None if state is None else self._view(state, read_nccl)

    def _view(self, state: GroupState, read_nccl: bool) -> GroupView:
        memory = self.memory(state) if read_nccl else None
        return GroupView(key=state.info.key, name=state.info.name, ranks=tuple(state.info.ranks),
                         status=state.status,
                         resuming=state.resume_queued and not state.finished.is_set(),
                         suspendable_bytes=state.suspendable,
                         nccl_suspended=None if memory is None else memory.suspended,
                         error=state.error)
