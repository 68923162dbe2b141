"""``RolloutSession``: the one rollout seam every adapter drives.

An adapter knows *where* a rollout starts and stops in its framework (which
method, which call inside it) and which groups generation uses. Everything
else is here, the same for TRL, verl and Megatron:

- the policy is built lazily, at the first rollout, when the groups exist;
- ``start``/``stop`` are idempotent: a framework may reach a seam twice
  (a second generate call in one phase, two engines), and only the first
  start and the first stop after it act;
- when to block: ``start(memory_needed_now=True)`` returns once the memory is
  free (a KV cache is allocated right after); ``stop`` returns once every
  group is back unless the caller says the next calls all go through the
  guard; the policy itself blocks where nothing else would protect a
  collective (guard off, or torch's GIL-holding path);
- a bounded history of reports and one ``metrics()`` covering begin and end.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Optional

from .report import TransitionReport

logger = logging.getLogger("amem_callbacks")

PHASE = "rollout"


class RolloutSession:
    """The rollout phase of one training process.

    ``start`` and ``stop`` are collective: every rank reaches them at the same
    point of the same framework call.

    Args:
        make_policy: builds the :class:`~amem_callbacks.OffloadPolicy` at the
            first ``start`` (the groups and the engine exist by then).
        phase: the phase name (``keep`` may be given per phase).
        history: how many (where, report) pairs to keep.

    Example:
        >>> session = RolloutSession(lambda: OffloadPolicy(keep=["tp"]))
        >>> session.start("engine.resume", memory_needed_now=True)
        >>> session.stop("engine.suspend")
    """

    def __init__(self, make_policy: Callable, *, phase: str = PHASE, history: int = 16):
        self._make_policy = make_policy
        self.phase = phase
        self.policy = None
        self.history: collections.deque = collections.deque(maxlen=history)
        self._lock = threading.RLock()

    def prepare(self):
        """Build the policy now if not yet (an adapter that decides at its first
        seam what the policy keeps); returns it."""
        with self._lock:
            if self.policy is None:
                self.policy = self._make_policy()
            return self.policy

    @property
    def active(self) -> bool:
        return self.policy is not None and self.policy.active_phase is not None

    def start(self, where: str, *, memory_needed_now: bool = True) -> Optional[TransitionReport]:
        """Collective: begin the phase (nothing when it is already active).

        Args:
            where: the seam, for logs and the history.
            memory_needed_now: return only once the suspended memory is free
                (something allocates right after); else an overlapped begin
                returns at once and the suspends run while generation computes.
        """
        with self._lock:
            self.prepare()
            if self.policy.active_phase is not None:
                return None
            report = self.policy.begin(self.phase)
            if memory_needed_now:
                self.policy.wait()
            return self._record(where, report)

    def stop(self, where: str, *, guarded_until_settle: bool = False) -> Optional[TransitionReport]:
        """Collective: end the phase (nothing when none is active).

        Args:
            guarded_until_settle: the caller knows every call until its next
                :meth:`settle` goes through ``torch.distributed``'s Python
                functions (which the guard holds back until their own group is
                back), so an overlapped resume may go on meanwhile. Otherwise
                ``stop`` returns once every group is back: DDP's reducer,
                DTensor and functional collectives bypass the guard.
        """
        with self._lock:
            if not self.active:
                return None
            report = self.policy.end(self.phase)
            if not guarded_until_settle:
                self.policy.wait()
            return self._record(where, report)

    def settle(self) -> None:
        """Wait for a transition still running (before calls the guard cannot see)."""
        if self.policy is not None:
            self.policy.wait()

    def store_barrier(self, name: str) -> list:
        """Collective over all ranks, through the c10d store (safe while NCCL
        groups are suspended): see :meth:`OffloadPolicy.store_barrier`."""
        return self.policy.store_barrier(name) if self.policy is not None else []

    def last(self, kind: str) -> Optional[TransitionReport]:
        """The latest finished report of ``kind`` ("begin" or "end")."""
        for _where, report in reversed(self.history):
            if report.kind == kind and not report.pending:
                return report
        return None

    def metrics(self, prefix: str = "amem/") -> dict:
        """Running totals, the last finished begin and end, and whether the policy
        is inert, as flat numbers for the framework's logger; {} before the first start."""
        if self.policy is None:
            return {}
        out = self.policy.metrics(prefix, last=False)
        out[prefix + "inert"] = int(self.policy.inert)
        for kind in ("begin", "end"):
            report = self.last(kind)
            if report is not None:
                out.update(report.as_dict(prefix))
        return out

    def _record(self, where: str, report: TransitionReport) -> TransitionReport:
        if not report.skipped:
            self.history.append((where, report))
        logger.debug("amem_callbacks: rollout %s at %s", report.kind, where)
        return report
