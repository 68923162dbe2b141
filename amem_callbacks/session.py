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
  returns at once with ``overlap``, and ``hold_s`` keeps the suspends back
  until ``start_suspends`` (the rollout's first GPU work goes first: NCCL's
  host pinning stalls the process's GPU work); ``stop`` returns once every
  group is back unless the caller says the next collectives all pass the guard;
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

The session is the policy's one friend: it alone reads the policy's internal
state (``_phase``, ``_setup``, ``_backend``, ``_agreement``, ``_placement``) and its memory wait
(``_wait_for_bytes``), so that the store rounds and the adapters' waiting live
here and the policy's public surface stays its verbs and read-only views.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Optional

from . import headroom
from .errors import OptionError
from .headroom import DEFAULT_MARGIN_BYTES
from .memory import device_free_bytes
from .checks import MAX_BYTES, check_number, check_wait
from .log import logger
from .report import TransitionReport
from .states import Kind, Status


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


class SessionViews:
    """What is shown of a rollout session, written once: :class:`RolloutSession`
    shows it of itself, and each adapter (TRL's callback, verl's worker session,
    Megatron's controller) of the session it holds in ``session``, which is None
    until the adapter makes it (then: no policy, not active, no reports, no
    metrics)."""

    session: Optional["RolloutSession"]  # the adapter's (set in its __init__)

    def _viewed(self) -> Optional["RolloutSession"]:
        return getattr(self, "session", None)

    @property
    def policy(self):
        """The :class:`~amem_callbacks.OffloadPolicy` it drives (None before it is made)."""
        session = self._viewed()
        return session._policy if session is not None else None

    @property
    def active(self) -> bool:
        """Whether the session's phase is open on this rank."""
        session = self._viewed()
        return session is not None and session._seam.phase_open

    @property
    def headroom(self):
        """What the first begin's freed memory allows the rollout engine's share, or None."""
        session = self._viewed()
        return session._headroom if session is not None else None

    @property
    def last_begin(self) -> Optional[TransitionReport]:
        """The latest finished begin report."""
        return self._last(Kind.BEGIN)

    @property
    def last_end(self) -> Optional[TransitionReport]:
        """The latest finished end report."""
        return self._last(Kind.END)

    def metrics(self, prefix: str = "amem/") -> dict:
        """The policy's figures (:meth:`OffloadPolicy.metrics`: totals, inert,
        pending, the last finished begin and end: the same keys as plain torch),
        plus the caller's waits and the headroom, flat for the framework's
        logger; {} before the policy's first begin set it up."""
        session = self._viewed()
        if session is None or (not session.history and not session._seam.set_up):
            return {}
        out = session._policy.metrics(prefix)
        for name, seconds in session.waited.items():
            out[f"{prefix}total/caller_wait_{name}_seconds"] = seconds
        out[f"{prefix}total/begins_not_needed"] = session._skipped_begins
        out[f"{prefix}total/begins_after_short_allocation"] = session._late_begins
        if session._headroom is not None:
            out.update(session._headroom.as_dict(prefix))
        return out

    def _last(self, kind: Kind) -> Optional[TransitionReport]:
        session = self._viewed()
        for _where, report in reversed(session.history if session is not None else ()):
            if report.kind == kind and not report.pending:
                return report
        return None


def lacking_bytes(allocating: int, free: Optional[int], shared_by: int = 1,
                  margin: int = DEFAULT_MARGIN_BYTES) -> Optional[int]:
    """What a begin must free before ``allocating`` bytes fit: None (all of it)
    when the free memory is unknown; else what ``free`` (this rank's part where
    ``shared_by`` ranks share the GPU, each allocating as much) lacks for the
    allocation and ``margin``; 0 when it fits."""
    if free is None:
        return None
    return max(0, allocating + margin - free // max(1, shared_by))


class RolloutSession(SessionViews):
    """The rollout phase of one training process.

    ``start`` and ``stop`` are collective: every rank reaches them at the same
    point of the same framework call. What it shows (``policy``, ``active``,
    ``headroom``, ``last_begin``, ``last_end``, ``metrics()``) is
    :class:`SessionViews`'.

    Args:
        policy: the :class:`~amem_callbacks.OffloadPolicy` to drive.
        phase: the phase name (``keep`` may be given per phase).
        history: how many (where, report) pairs to keep.
    """

    def __init__(self, policy, *, phase: str = PHASE, history: int = 16):
        from .policy import PolicySeam  # light import: the policy module at use

        self._policy = policy
        self._seam = PolicySeam(policy)  # all the session reads of the policy
        self.phase = phase
        self.history: collections.deque = collections.deque(maxlen=history)
        self.waited = {"start": 0.0, "stop": 0.0, "memory": 0.0}  # caller seconds, cumulative
        self._skipped_begins = 0  # begins every rank skipped: nothing lacked (start())
        self._late_begins = 0  # skipped begins made after all: an allocation fell short
        self._headroom = None  # see tell_headroom
        self._lock = threading.RLock()

    def _viewed(self) -> "RolloutSession":
        return self

    # --- the phase ---------------------------------------------------------
    def start(self, where: str, *, need_bytes: Optional[int] = None,
              hold_s: float = 0.0, allocating_bytes: Optional[int] = None,
              margin_bytes: int = DEFAULT_MARGIN_BYTES) -> Optional[TransitionReport]:
        """Collective: begin the phase (nothing when it is already active).

        Args:
            where: the seam, for logs and the history.
            need_bytes: return once the begin has freed this many bytes on this
                rank (something allocates right after); None waits for the
                whole begin; 0 returns at once when the policy overlaps.
            hold_s: with ``need_bytes=0``, hold this rank's suspends until
                :meth:`start_suspends` (at most this long): the rollout's first
                GPU work goes before them (``OffloadPolicy.begin``'s ``hold_s``).
            allocating_bytes: instead of ``need_bytes``: this rank allocates this
                many bytes right after; wait only for what the device's free
                memory (before the begin, this rank's part of it where ranks share
                the GPU, less a margin) lacks: nothing when it all fits. After the
                first begin, where no rank lacks anything, every rank skips the
                begin (a skipped report, ``waited_for_bytes`` 0; the phase does not
                become active, so the caller's ``stop`` does nothing). A caller
                that can tell when its allocation fell short anyway calls
                :meth:`start_if_any_rank_fell_short` right after it.
            margin_bytes: with ``allocating_bytes``: free memory that must stay
                beyond the allocation for it to count as fitting.
        """
        if hold_s and need_bytes != 0:
            raise OptionError(f"start(hold_s={hold_s!r}) holds the suspends, so it cannot "
                              f"also wait for them (need_bytes={need_bytes!r}): pass "
                              "need_bytes=0, or hold_s=0 to wait")
        if allocating_bytes is not None:
            check_number("allocating_bytes", allocating_bytes, minimum=0, integer=True,
                         maximum=MAX_BYTES, why="2**63 - 1: NCCL counts bytes in 64 bits")
            check_number("margin_bytes", margin_bytes, minimum=0, integer=True,
                         maximum=MAX_BYTES, why="2**63 - 1: NCCL counts bytes in 64 bits")
            if need_bytes is not None or hold_s:
                raise OptionError("start(allocating_bytes=...) works out what to wait for "
                                  f"itself: drop need_bytes={need_bytes!r} and "
                                  f"hold_s={hold_s!r}, or drop allocating_bytes")
        with self._lock:
            if self.active:
                return None
            began = time.monotonic()
            free_before = (device_free_bytes(self._policy.options.device)
                           if allocating_bytes is not None else None)
            if allocating_bytes is not None and self.history:
                skipped = self._skip_if_no_rank_lacks(where, allocating_bytes, free_before,
                                                      margin_bytes)
                if skipped is not None:
                    self.waited["start"] += time.monotonic() - began
                    return skipped
            # hold_s only when asked: a policy subclass with the older begin(phase) works on
            report = (self._policy.begin(self.phase, hold_s=hold_s) if hold_s
                      else self._policy.begin(self.phase))
            if allocating_bytes is not None:
                need_bytes = lacking_bytes(allocating_bytes, free_before,
                                           report.device_shared_by, margin_bytes)
                report.waited_for_bytes = need_bytes
            if need_bytes is None:
                self._policy.wait()
            elif need_bytes > 0:
                self._wait_for_bytes(need_bytes, None)
            self.waited["start"] += time.monotonic() - began
            return self._record(where, report)

    def _skip_if_no_rank_lacks(self, where: str, allocating: int, free: Optional[int],
                               margin: int) -> Optional[TransitionReport]:
        """Collective (a store round, never NCCL): where no rank lacks memory for what
        it allocates next, suspending frees nothing anyone uses and its resume still
        costs the next step (the training step waits for it), so every
        rank skips this begin; else None and they all begin. The first begin always
        runs (it measures what the headroom line reports). Every rank decides from the
        same exchanged values; one that did not arrive in time counts as lacking."""
        mine = lacking_bytes(allocating, free, self._sharing_my_device(), margin)
        seen, late = self.store_exchange(f"lacking/{self.phase}",
                                         "unknown" if mine is None else str(mine))
        if late or not seen or any(v == "unknown" or int(v) > 0 for v in seen.values()):
            return None
        self._skipped_begins += 1
        logger.debug("amem_callbacks: rollout begin at %s skipped: every rank's next "
                     "allocation fits in its free memory", where)
        return TransitionReport(phase=self.phase, kind=Kind.BEGIN,
                                backend=self._seam.backend_name,
                                skipped="not needed: every rank's next allocation fits in "
                                        "the free memory", waited_for_bytes=0)

    def start_if_any_rank_fell_short(self, where: str, fell_short: bool
                                     ) -> Optional[TransitionReport]:
        """Collective (a store round, never NCCL), right after the allocation that a
        begin every rank skipped was for (``start(allocating_bytes=)``): where that
        allocation ran out of memory on any rank after all (``fell_short``; a rank
        that does not answer in time counts as short), every rank begins now and
        waits for the whole of it, so the short rank can allocate again; else
        nothing (None). The estimate behind a skip cannot see every peak; this keeps
        a wrong one from ending the run where the suspends would have made room."""
        with self._lock:
            if self.active:
                return None
            began = time.monotonic()
            seen, late = self.store_exchange(f"short/{self.phase}", "1" if fell_short else "0")
            if not seen or (not late and all(v == "0" for v in seen.values())):
                return None
            logger.warning("amem_callbacks: %s ran out of memory on rank(s) %s although the "
                           "free memory looked enough; every rank suspends now and it "
                           "allocates again", where,
                           sorted(set(late) | {r for r, v in seen.items() if v != "0"}))
            self._skipped_begins -= 1  # that skip did not stand
            self._late_begins += 1
            report = self._policy.begin(self.phase)
            self._policy.wait()
            self.waited["start"] += time.monotonic() - began
            return self._record(where, report)

    def start_suspends(self, where: str = "") -> bool:
        """Not collective, never blocks: let the suspends a ``start(hold_s=...)``
        holds start now (each rank at its own moment; every rank must come here,
        to ``stop``, or let ``hold_s`` pass). Whether any were held."""
        started = self._policy.start_suspends()
        if started:
            logger.debug("amem_callbacks: held suspends start at %s", where)
        return started

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
            report = self._policy.end(self.phase)
            if not guarded_until_settle:
                self._policy.wait()
            self.waited["stop"] += time.monotonic() - began
            return self._record(where, report)

    def settle(self) -> None:
        """Wait for a transition still running (before calls the guard cannot see)."""
        began = time.monotonic()
        self._policy.wait()
        self.waited["stop"] += time.monotonic() - began

    # --- waiting for the freed memory ---------------------------------------
    def wait_for_memory(self, nbytes: Optional[int] = None,
                        timeout_s: Optional[float] = None) -> int:
        """Block until the running begin has freed ``nbytes`` on this rank (by
        NCCL's account; default: all it will free), or has finished; returns
        the bytes freed by the latest begin so far (0 when nothing was
        suspended). Where something allocates at once (a KV cache), call it
        just before: an overlapped begin's suspends run while everything
        before it runs. ``timeout_s``: default the policy's ``timeout_s``,
        else the slowest group's c10d timeout."""
        began = time.monotonic()
        try:
            return self._wait_for_bytes(nbytes, timeout_s)
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
        if self._seam.dry_run:
            nbytes = 0  # a dry run frees nothing
        else:  # groups the guard has resumed since hold their memory again
            nbytes = sum(view.suspendable_bytes or 0 for view in self._policy.groups()
                         if view.status == Status.SUSPENDED and not view.resuming)
        return Freed(nbytes, done, begin.started + begin.wall_seconds if done else None)

    # --- the adapters' own rounds, over the c10d store ------------------------
    def store_exchange(self, name: str, value: str, ranks=None) -> tuple:
        """Collective over ``ranks`` (default all): share one string through the
        c10d store, never NCCL, so it is safe while groups are suspended; bounded
        by ``agree_timeout_s``. Returns ``({rank: value}, [ranks that did not
        arrive in time])``; ``({}, [])`` before the policy's first begin."""
        return self._seam.share(name, value, ranks)

    def store_barrier(self, name: str) -> list:
        """Collective over all ranks: return once every rank has called it with
        the same ``name``, or after ``agree_timeout_s``; through the c10d store
        (an adapter uses it when one rank's next step needs every rank's memory
        free). Returns the ranks that did not arrive in time (empty: all did)."""
        return self.store_exchange(name, "here")[1]

    # --- figures --------------------------------------------------------------
    def tell_headroom(self, setting: str, current: Optional[float],
                      report: Optional[TransitionReport],
                      free_at_fullest: Optional[int] = None) -> None:
        """Log how far the rollout engine's memory share ``setting`` (now ``current``)
        can rise with the memory this rollout's ``report`` freed (vLLM sizes its KV
        cache at start-up): at the first begin that freed something, and again where a
        later rollout lowers it; ``metrics()`` carries it too. ``free_at_fullest``:
        this rank's free memory at the rollout's fullest (:meth:`free_here`), where
        the adapter can read it; it bounds the raise."""
        # A rollout whose begin was skipped tells nothing new: every rank had room for
        # what it allocated, with its groups' bytes still allocated on top.
        freed = headroom.freed_on_this_gpu(report)
        if freed is not None:
            self._headroom = headroom.tell(setting, current, freed, self._policy.options.device,
                                           room_bytes=free_at_fullest, previous=self._headroom)

    def free_here(self) -> Optional[int]:
        """This rank's part of the device's free memory now: the device's, shared
        among the ranks on it (each runs its own engine); None without CUDA."""
        free = device_free_bytes(self._policy.options.device)
        return None if free is None else free // self._sharing_my_device()

    def _sharing_my_device(self) -> int:
        return self._seam.sharing_my_device()

    def _wait_for_bytes(self, nbytes: Optional[int], timeout_s: Optional[float]) -> int:
        if nbytes is not None:
            check_number("nbytes", nbytes, minimum=0, integer=True, maximum=MAX_BYTES,
                         why="2**63 - 1: NCCL counts bytes in 64 bits")
        if timeout_s is not None:
            check_wait("timeout_s", timeout_s)
        return self._seam.wait_for_bytes(nbytes, timeout_s)

    def _record(self, where: str, report: TransitionReport) -> TransitionReport:
        if not report.skipped:
            self.history.append((where, report))
        logger.debug("amem_callbacks: rollout %s at %s", report.kind, where)
        return report
