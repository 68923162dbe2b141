"""``RolloutSession``: the one rollout seam every adapter drives, and the way
to add a framework.

An adapter knows *where* a rollout starts and stops in its framework (which
method, which call inside it) and which groups generation uses; it builds an
:class:`~amem_callbacks.OffloadPolicy` from that and hands it over. The
session does the rest, the same for TRL, verl and Megatron:

- ``start``/``stop`` are idempotent: a framework may reach a seam twice
  (a second generate call in one phase, two engines), and only the first
  start and the first stop after it act; whether a phase is active is the
  policy's to say;
- when to block: ``start(need_bytes=...)`` returns once that much memory is
  free (a KV cache is allocated right after), ``start(need_bytes=0)``
  returns at once with ``overlap``; ``stop`` returns once every group is
  back unless the caller says the next collectives all pass the guard;
- how long the caller waited, per call, for the critical-path figures;
- a bounded history of reports and one ``metrics()`` covering begin and end.

Example (a new framework)::

    session = RolloutSession(OffloadPolicy(keep=["tp"], overlap=True))

    def generate(batch):                        # the framework's rollout
        session.start("generate", need_bytes=0) # every rank, same order
        try:
            return engine.generate(batch)
        finally:
            session.stop("generate", guarded_until_settle=True)
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

from .report import TransitionReport
from .states import Kind, Status

logger = logging.getLogger("amem_callbacks")

PHASE = "rollout"


@dataclass(frozen=True)
class Freed:
    """What the running begin has freed on this rank so far (:meth:`RolloutSession.freed`)."""

    #: NCCL's suspendable bytes of the groups suspended now (0 for a dry run)
    nbytes: int
    #: the begin's suspends are over (and their outcomes exchanged), or none runs
    done: bool
    #: ``time.monotonic()`` when they were over; None while they run or without a begin
    done_at: Optional[float] = None


class RolloutSession:
    """The rollout phase of one training process.

    ``start`` and ``stop`` are collective: every rank reaches them at the same
    point of the same framework call.

    Args:
        policy: the :class:`~amem_callbacks.OffloadPolicy` to drive.
        phase: the phase name (``keep`` may be given per phase).
        history: how many (where, report) pairs to keep.
    """

    def __init__(self, policy, *, phase: str = PHASE, history: int = 16):
        self.policy = policy
        self.phase = phase
        self.history: collections.deque = collections.deque(maxlen=history)
        self.waited = {"start": 0.0, "stop": 0.0, "memory": 0.0}  # caller seconds, cumulative
        self.headroom = None  # see tell_headroom
        self._lock = threading.RLock()

    @property
    def active(self) -> bool:
        return self.policy.active_phase is not None

    def start(self, where: str, *, need_bytes: Optional[int] = None) -> Optional[TransitionReport]:
        """Collective: begin the phase (nothing when it is already active).

        Args:
            where: the seam, for logs and the history.
            need_bytes: return once the begin has freed this many bytes on this
                rank (something allocates right after); None waits for the
                whole begin; 0 returns at once when the policy overlaps.
        """
        with self._lock:
            if self.active:
                return None
            began = time.monotonic()
            report = self.policy.begin(self.phase)
            if need_bytes is None:
                self.policy.wait()
            elif need_bytes > 0:
                self.policy.wait_for_free(need_bytes)
            self.waited["start"] += time.monotonic() - began
            return self._record(where, report)

    def wait_for_memory(self, nbytes: Optional[int] = None) -> int:
        """Block until the running begin has freed ``nbytes`` (default: all it
        will free) on this rank; returns the bytes freed so far."""
        began = time.monotonic()
        try:
            return self.policy.wait_for_free(nbytes)
        finally:
            self.waited["memory"] += time.monotonic() - began

    def freed(self) -> Freed:
        """Not collective, never blocks: how far the running begin has got on this
        rank, for a caller that grows into the memory once it is free instead of
        waiting for it (:meth:`wait_for_memory`)."""
        begin = next((r for _w, r in reversed(self.history) if r.kind == Kind.BEGIN), None)
        if begin is None or not self.active:
            return Freed(0, True)
        done = not begin.pending
        if getattr(self.policy.backend, "dry_run", False):
            nbytes = 0  # a dry run frees nothing
        else:  # groups the guard has resumed since hold their memory again
            nbytes = sum(view.suspendable_bytes or 0 for view in self.policy.groups()
                         if view.status == Status.SUSPENDED and not view.resuming)
        return Freed(nbytes, done, begin.started + begin.wall_seconds if done else None)

    def stop(self, where: str, *, guarded_until_settle: bool = False) -> Optional[TransitionReport]:
        """Collective: end the phase (nothing when none is active).

        Args:
            guarded_until_settle: the caller knows every collective until its
                next :meth:`settle` goes through ProcessGroup's Python methods
                (which the guard holds back until their own group is back),
                so an overlapped resume may go on meanwhile. Otherwise ``stop``
                returns once every group is back: DDP's C++ reducer, DTensor
                and functional collectives bypass the guard.
        """
        with self._lock:
            if not self.active:
                return None
            began = time.monotonic()
            report = self.policy.end(self.phase)
            if not guarded_until_settle:
                self.policy.wait()
            self.waited["stop"] += time.monotonic() - began
            return self._record(where, report)

    def settle(self) -> None:
        """Wait for a transition still running (before calls the guard cannot see)."""
        began = time.monotonic()
        self.policy.wait()
        self.waited["stop"] += time.monotonic() - began

    def store_barrier(self, name: str) -> list:
        """Collective over all ranks, through the c10d store (safe while NCCL
        groups are suspended): see :meth:`OffloadPolicy.store_barrier`."""
        return self.policy.store_barrier(name)

    def tell_headroom(self, setting: str, current: Optional[float],
                      report: Optional[TransitionReport]) -> None:
        """Once, at the first begin that freed something: log how far the rollout
        engine's memory share ``setting`` (now ``current``) can rise with the freed
        memory (vLLM sizes its KV cache at start-up); ``metrics()`` carries it too."""
        if self.headroom is not None or report is None or report.skipped:
            return
        from . import headroom

        self.headroom = headroom.tell(setting, current, report, self.policy.options.device)

    def last(self, kind: str) -> Optional[TransitionReport]:
        """The latest finished report of ``kind`` ("begin" or "end")."""
        for _where, report in reversed(self.history):
            if report.kind == kind and not report.pending:
                return report
        return None

    def metrics(self, prefix: str = "amem/") -> dict:
        """The policy's figures (:meth:`OffloadPolicy.metrics`: totals, inert,
        pending, the last finished begin and end: the same keys as plain torch),
        plus the caller's waits and the headroom, flat for the framework's
        logger; {} before the first start."""
        if not self.history and self.policy.backend is None:
            return {}
        out = self.policy.metrics(prefix)
        for name, seconds in self.waited.items():
            out[f"{prefix}total/caller_wait_{name}_seconds"] = seconds
        if self.headroom is not None:
            out.update(self.headroom.as_dict(prefix))
        return out

    def _record(self, where: str, report: TransitionReport) -> TransitionReport:
        if not report.skipped:
            self.history.append((where, report))
        logger.debug("amem_callbacks: rollout %s at %s", report.kind, where)
        return report


class SessionViews:
    """What an adapter shows of its ``session`` (None until it is made): the
    same properties on TRL's callback, verl's worker session and Megatron's
    controller."""

    session: Optional[RolloutSession] = None

    @property
    def policy(self):
        return self.session.policy if self.session is not None else None

    @property
    def active(self) -> bool:
        return self.session is not None and self.session.active

    @property
    def headroom(self):
        """What the first begin's freed memory allows the rollout engine's share, or None."""
        return self.session.headroom if self.session is not None else None

    @property
    def last_begin(self) -> Optional[TransitionReport]:
        return self.session.last("begin") if self.session is not None else None

    @property
    def last_end(self) -> Optional[TransitionReport]:
        return self.session.last("end") if self.session is not None else None

    def metrics(self, prefix: str = "amem/") -> dict:
        """This rank's ``amem/...`` figures, flat (see :meth:`RolloutSession.metrics`)."""
        return self.session.metrics(prefix) if self.session is not None else {}
