"""``OffloadPolicy``: suspend idle NCCL groups for a phase, resume them after."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterable, Mapping, Optional, Union

from .backends import CHOICES, select_backend, validate_backend_name
from .learning import LearnedKeeps
from .options import check_number, check_phase, normalise_keep
from .report import Counters, TransitionReport
from .states import GuardMode, Kind

logger = logging.getLogger("amem_callbacks")

DEFAULT_MIN_BYTES = 16 * 2**20
# Measured on 2xH200, 8 groups (results/bench.json): one transition takes
# suspend 2.63 / 2.41 / 2.38 s and resume 2.01 / 1.46 / 1.27 s with 1 / 4 / 8
# threads; past 4 threads NCCL's own barriers dominate.
DEFAULT_WORKERS = 4


class OffloadPolicy:
    """Frees the device memory of idle NCCL communicators during a phase.

    ``begin(phase)`` and ``end(phase)`` are collective: every rank calls them,
    in the same order relative to its other collective calls. Each call is
    bounded in time; no rank waits forever for another.

    Args:
        backend: "auto" (nccl, then amem, else leave training untouched),
            "nccl", "amem", "noop" (dry run), or a Backend instance.
        keep: names of groups the phase still uses (roles such as "tp", a
            ``group_desc``, "world"), for every phase; or a dict
            ``{phase: names}``.
        learn_keep: a group the guard had to resume during a phase stays
            active in that phase from the next ``begin`` on (see
            :mod:`amem_callbacks.learning`); ``forget_learned()`` undoes it.
        min_bytes: groups with less suspendable NCCL memory stay active.
        guard: "resume" (a call on a suspended group resumes it first),
            "strict" (such a call raises), or "off".
        overlap: ``begin``/``end`` return at once and the transition runs in
            the background; a call on a group waits for it (via the guard).
            With ``guard="off"`` nothing would make a call wait, so ``end``
            waits for its resumes itself.
        workers: threads that suspend/resume the groups of one transition
            concurrently (each communicator has its own barrier); 1 runs them
            one after another. See DEFAULT_WORKERS for the measurement.
        timeout_s: longest wait for one suspend/resume; default: the group's
            c10d timeout.
        agree_timeout_s: how long members wait for each other to agree on a
            plan before leaving a group active.
        host_memory_cap_bytes: most bytes NCCL may copy to pinned host memory;
            groups past the cap stay active.
        groups: consider only these process groups (default: all).
        backend_options: per-backend keyword arguments, e.g.
            ``{"amem": {"library_path": "...", "group_id": 1}}`` or
            ``{"nccl": {"path": "torch"}}``.
        device: the CUDA device index this rank's communicators live on;
            default: the current device of the thread that calls the first
            ``begin`` (pass it when that thread is not the training thread).

    Example:
        >>> policy = OffloadPolicy(keep=["tp"])
        >>> with policy.phase("rollout"):
        ...     outputs = engine.generate(prompts)
    """

    def __init__(self, backend: Union[str, object] = "auto",
                 keep: Union[Iterable[str], Mapping[str, Iterable[str]]] = (), *,
                 learn_keep: bool = True, min_bytes: int = DEFAULT_MIN_BYTES,
                 guard: str = "resume", overlap: bool = False, workers: int = DEFAULT_WORKERS,
                 timeout_s: Optional[float] = None, agree_timeout_s: float = 120.0,
                 host_memory_cap_bytes: Optional[int] = None, groups: Optional[Iterable] = None,
                 backend_options: Optional[dict] = None, device: Optional[int] = None):
        if isinstance(backend, str):
            validate_backend_name(backend)
        elif not all(hasattr(backend, a) for a in ("check", "suspend", "resume", "communicator")):
            raise ValueError(f"backend must be one of {CHOICES} or a Backend instance, "
                             f"got {backend!r}")
        if guard not in tuple(GuardMode):
            raise ValueError(f"unknown guard mode {guard!r}: write one of "
                             f"{tuple(m.value for m in GuardMode)}")
        check_number("min_bytes", min_bytes, minimum=0, integer=True)
        check_number("workers", workers, minimum=1, integer=True)
        check_number("agree_timeout_s", agree_timeout_s, minimum=0, exclusive=True)
        if timeout_s is not None:
            check_number("timeout_s", timeout_s, minimum=0, exclusive=True)
        if host_memory_cap_bytes is not None:
            check_number("host_memory_cap_bytes", host_memory_cap_bytes, minimum=0,
                         integer=True)
        if device is not None:
            check_number("device", device, minimum=0, integer=True)
        for flag, value in (("overlap", overlap), ("learn_keep", learn_keep)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag} must be True or False, got {value!r}")
        if backend_options is not None and not isinstance(backend_options, dict):
            raise ValueError("backend_options must be a dict such as "
                             "{'amem': {'library_path': '/path/libnccl.so.2'}}")
        unknown_options = set(backend_options or {}) - set(CHOICES)
        if unknown_options:
            raise ValueError(f"backend_options has unknown backends {sorted(unknown_options)}: "
                             f"use {CHOICES[1:]}")
        self._keep = normalise_keep(keep)
        self.backend_spec = backend
        self.learn_keep = learn_keep
        self.min_bytes = min_bytes
        self.guard_mode = GuardMode(guard)
        self.overlap = overlap
        self.workers = workers
        self.device = device
        self.timeout_s = timeout_s
        self.agree_timeout_s = agree_timeout_s
        self.host_memory_cap_bytes = host_memory_cap_bytes
        self._only = list(groups) if groups is not None else None
        self._backend_options = backend_options or {}
        self.counters = Counters()
        self.last_report: Optional[TransitionReport] = None
        self.learned = LearnedKeeps()
        self.placement = None
        self.backend = None
        self.backend_description = ""
        self.inert = False
        self._engine = None
        self._phase: Optional[str] = None
        self._pending = None
        self._lock = threading.RLock()

    # --- public ----------------------------------------------------------
    @property
    def active_phase(self) -> Optional[str]:
        return self._phase

    def keep_for(self, phase: str) -> frozenset:
        return self._keep.get(phase, frozenset()) | self._keep.get("*", frozenset())

    def begin(self, phase: str = "rollout") -> TransitionReport:
        """Collective over all ranks: suspend the groups ``phase`` leaves idle.

        Defined corner cases: called while a phase is active, it does nothing
        and logs a warning; before ``init_process_group`` it does nothing.
        """
        check_phase(phase)
        with self._lock:
            if self._phase is not None:
                logger.warning("amem_callbacks: begin(%r) while phase %r is active: ignored",
                               phase, self._phase)
                return self._skipped(phase, Kind.BEGIN, f"phase {self._phase!r} is already active")
            self._phase = phase
            if not _distributed_ready():
                return self._skipped(phase, Kind.BEGIN, "torch.distributed is not initialized")
            self._setup()
            if self.inert:
                return self._skipped(phase, Kind.BEGIN, self.backend_description)
            self._wait_pending()
            self.counters.begins += 1
            report = TransitionReport(phase=phase, kind=Kind.BEGIN, backend=self.backend.name,
                                      started=time.monotonic(), pending=True,
                                      device_shared_by=self.placement.sharing_my_device(),
                                      learned=self.learned.by_phase().get(phase, {}))
            from .groups import discover
            from .memory import on_device
            from .plan import make_plan

            with on_device(self._engine.device):  # torch's pointer is per current device
                groups = discover(self.backend, self._only, self.placement)
            plan = make_plan(groups, phase, self.keep_for(phase), self.min_bytes,
                             self.host_memory_cap_bytes, self.backend.process_wide,
                             self.backend.name, learned=self.learned.reasons(phase))
            return self._run(self._engine.begin(report, groups, plan), report)

    def end(self, phase: Optional[str] = None) -> TransitionReport:
        """Collective over all ranks: resume what ``begin`` suspended.

        ``end`` with no active phase does nothing; ``end`` naming a phase
        other than the active one raises ValueError.
        """
        if phase is not None:
            check_phase(phase)
        with self._lock:
            if self._phase is None:
                logger.debug("amem_callbacks: end(%r) with no active phase: ignored", phase)
                return self._skipped(phase or "", Kind.END, "no phase is active")
            if phase is not None and phase != self._phase:
                raise ValueError(f"end({phase!r}) but the active phase is {self._phase!r}: "
                                 f"call end({self._phase!r})")
            phase, self._phase = self._phase, None
            if self._engine is None:
                return self._skipped(phase, Kind.END, self.backend_description
                                     or "torch.distributed is not initialized")
            self.counters.ends += 1
            resumed = self._engine.take_guard_resumes()
            if self.learn_keep and resumed:
                self.learned.note(phase, resumed)
            report = TransitionReport(phase=phase, kind=Kind.END, backend=self.backend.name,
                                      started=time.monotonic(), pending=True,
                                      device_shared_by=self.placement.sharing_my_device(),
                                      learned=self.learned.by_phase().get(phase, {}))
            report = self._run(self._engine.end(report), report)
            if self.guard_mode is GuardMode.OFF:
                self._wait_pending()  # nothing else holds a call back until its group is back
            return report

    @contextlib.contextmanager
    def phase(self, name: str = "rollout"):
        """``with policy.phase("rollout"): ...``: begin on entry, end on exit.

        If the body raises, the groups are *not* resumed (that is collective
        and the other ranks may not be here); the guard resumes a group if the
        program uses it again.
        """
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
        with self._lock:
            self._wait_pending(timeout_s)
            return self.last_report

    def forget_learned(self, phase: Optional[str] = None) -> None:
        """Drop the learned keep-sets (of one phase, or all): after the model or
        the process groups changed, the next phases learn afresh."""
        self.learned.forget(phase)

    def metrics(self, prefix: str = "amem/", last: bool = True) -> dict:
        """Running totals, learned keeps and (``last``) the last finished transition, flat."""
        out = self.counters.as_dict(prefix)
        for phase, groups in self.learned.by_phase().items():
            for name, count in groups.items():
                out[f"{prefix}learned/{phase}/{name}"] = count
        if last and self.last_report is not None and not self.last_report.pending:
            out.update(self.last_report.as_dict(prefix))
        return out

    def store_barrier(self, name: str) -> list:
        """Collective over all ranks: return once every rank has called it with
        the same ``name``, or after ``agree_timeout_s``. It goes through the
        c10d store, never NCCL, so it is safe while groups are suspended (an
        adapter uses it when one rank's next step needs every rank's memory
        free). Returns the ranks that did not arrive in time (empty: all did).
        """
        if self._engine is None:  # inert, or before the first begin: nothing to line up
            return []
        import torch.distributed as dist

        key = f"__barrier__/{name}"
        world = tuple(range(dist.get_world_size()))
        arrived = self._engine.agreement.exchange({key: (world, "here")})[key]
        return [rank for rank, value in arrived.items() if value is None]

    def close(self) -> None:
        """End an active phase (collective) and wait for pending work."""
        if self._phase is not None:
            self.end()
        self.wait()

    # --- internals -------------------------------------------------------
    def _run(self, task, report: TransitionReport) -> TransitionReport:
        self.last_report = report
        self._pending = task
        if not self.overlap or report.gil_held:
            self._wait_pending()
        return report

    def _wait_pending(self, timeout_s: Optional[float] = None) -> None:
        from .errors import TransitionTimeout

        task, self._pending = self._pending, None
        if task is None:
            return
        try:
            task.wait(timeout_s or self.timeout_s or self._engine.longest_timeout_s())
        except TransitionTimeout as exc:
            stuck = self._engine.unfinished_groups()
            raise TransitionTimeout(f"{exc} Groups not finished on this rank: {stuck}.") from None

    def _skipped(self, phase: str, kind: Kind, why: str) -> TransitionReport:
        report = TransitionReport(phase=phase, kind=kind,
                                  backend=getattr(self.backend, "name", "none"), skipped=why)
        self.last_report = report
        return report

    def _setup(self) -> None:
        """First begin on this rank: pick a backend and make all ranks agree on it."""
        if self._engine is not None or self.inert:
            return
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        from .agreement import (Agreement, reason_of, shared_rounds, verdict_of, vote_keep,
                                vote_suspend)
        from .memory import current_device
        from .placement import exchange
        from .states import Verdict
        from .transitions import Transitions

        backend, description, inert = select_backend(self.backend_spec, self._backend_options)
        agreement = Agreement(c10d._get_default_store(), dist.get_rank(), self.agree_timeout_s,
                              rounds=shared_rounds(c10d._get_default_group()))
        world = tuple(range(dist.get_world_size()))
        vote = vote_keep(description) if inert else vote_suspend(backend.name)
        agreed = agreement.decide({"__backend__": (world, vote)})["__backend__"]
        self.backend = backend
        if verdict_of(agreed) is not Verdict.SUSPEND:
            if not inert:
                logger.warning("amem_callbacks: not every rank can use backend %r (%s); "
                               "training runs unchanged", backend.name, reason_of(agreed))
            self.inert = True
            self.backend_description = reason_of(agreed)
            return
        self.backend_description = description
        device = self.device if self.device is not None else current_device()
        if hasattr(backend, "device"):
            backend.device = device
        self.placement = exchange(agreement, world, dist.get_rank(), device)
        self._engine = Transitions(backend, agreement, device, self.timeout_s,
                                   self.counters, workers=self.workers,
                                   strict=self.guard_mode is GuardMode.STRICT,
                                   guarded=self.guard_mode is not GuardMode.OFF)


def _distributed_ready() -> bool:
    import sys

    if "torch" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
