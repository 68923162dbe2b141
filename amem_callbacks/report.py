"""Typed results of transitions, and their flat ``amem/...`` form for loggers."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Optional

from .states import Kind, Outcome, Status


@dataclass(frozen=True)
class GroupReport:
    """One group's row of a transition report (a new row for every change: the worker
    that made it and the report that holds it never share a mutable one)."""

    key: str
    name: str
    size: int
    action: Outcome
    reason: str = ""
    suspendable_bytes: Optional[int] = None
    persist_bytes: Optional[int] = None
    seconds: float = 0.0
    error: Optional[str] = None
    #: the backend's way to this group's communicator ("ctypes", "torch-native", ...)
    path: str = ""
    #: bytes of the group's other communicators the backend cannot reach, and why
    unreached_bytes: int = 0
    unreached_why: str = ""
    #: "intra-node" or "network (N hosts)"
    transport: str = ""

    @property
    def stays_bytes(self) -> int:
        """Device bytes of this group that a suspend leaves allocated."""
        return (self.persist_bytes or 0) + self.unreached_bytes

    @property
    def stays_why(self) -> str:
        """Why those bytes stay, as far as NCCL and torch tell."""
        parts = []
        if self.persist_bytes:
            what = ("network-transport buffers and NCCL's own state"
                    if self.transport.startswith("network") else
                    "NCCL's own state (and NVLS buffers where NVLS is on)")
            parts.append(f"{self.persist_bytes / 2**20:.1f} MiB persistent per NCCL: {what}")
        if self.unreached_bytes:
            parts.append(f"{self.unreached_bytes / 2**20:.1f} MiB not reached: "
                         f"{self.unreached_why}")
        return "; ".join(parts)


def group_row(info, action: Outcome, reason: str = "", suspendable: Optional[int] = None,
              path: str = "") -> GroupReport:
    """The row of an operation on the group ``info`` (groups.GroupInfo), before it runs:
    what NCCL said of its memory, how the backend reaches it."""
    memory = info.memory
    return GroupReport(
        key=info.key, name=info.name, size=len(info.ranks), action=action, reason=reason,
        suspendable_bytes=suspendable if suspendable is not None else (
            memory.suspendable if memory else None),
        persist_bytes=memory.persist if memory else None,
        unreached_bytes=memory.unreached_bytes if memory else 0,
        unreached_why=memory.unreached_why if memory else "", path=path,
        transport=info.transport)


@dataclass(frozen=True)
class GroupView:
    """A read-only snapshot of one group the policy holds, from
    ``OffloadPolicy.groups()`` or ``OffloadPolicy.view(group)``: for a user's
    own logging as much as for tests. A group the policy does not hold is
    active and has no view.
    """

    key: str
    name: str
    ranks: tuple
    #: suspending, suspended or broken (a failed resume: calls on it raise)
    status: Status
    #: a resume is queued (by ``end`` or the guard) and has not finished yet
    resuming: bool
    suspendable_bytes: Optional[int]
    #: NCCL's own word (``ncclCommMemStats``) when asked with ``read_nccl=True``
    nccl_suspended: Optional[bool] = None
    error: Optional[str] = None

    def as_dict(self) -> dict:
        return {"key": self.key, "name": self.name, "ranks": list(self.ranks),
                "status": str(self.status), "resuming": self.resuming,
                "suspendable_bytes": self.suspendable_bytes,
                "nccl_suspended": self.nccl_suspended, "error": self.error}


@dataclass
class TransitionReport:
    """What one ``begin`` or ``end`` did on this rank."""

    phase: str
    kind: Kind
    backend: str
    groups: list = field(default_factory=list)
    device_free_before: Optional[int] = None
    device_free_after: Optional[int] = None
    host_rss_before: Optional[int] = None
    host_rss_after: Optional[int] = None
    agree_seconds: float = 0.0
    total_seconds: float = 0.0  # agreement + NCCL calls of this rank
    wall_seconds: float = 0.0  # from the call until the transition had finished
    started: float = 0.0  # time.monotonic() at the call
    skipped: Optional[str] = None  # why the whole transition did nothing
    pending: bool = False  # True while an overlapped transition still runs
    #: some group went through torch's GIL-holding methods: the batch ran one
    #: call at a time and the caller waited for it, whatever ``overlap`` said
    gil_held: bool = False
    #: ranks of this job on this GPU: above 1, the device_* figures are the
    #: whole GPU's (every sharing rank's memory), not this rank's
    device_shared_by: int = 1
    #: group name -> guard resumes that made it a learned keep for this phase
    learned: dict = field(default_factory=dict)
    #: names of the groups this transition moves, known when it is queued
    planned: list = field(default_factory=list)
    #: a begin asked to hold its suspends up to this long (``begin(hold_s=)``)
    hold_s: float = 0.0
    #: ... and the seconds from the call until they started (0: not held)
    held_seconds: float = 0.0
    #: a begin told what its caller allocates next (``start(allocating_bytes=)``):
    #: the bytes it waited to have freed (0: none, it all fit; None: not told)
    waited_for_bytes: Optional[int] = None

    def _with(self, action: Outcome) -> list:
        return [g for g in self.groups if g.action == action]

    @property
    def suspended(self) -> list:
        return self._with(Outcome.SUSPENDED)

    @property
    def kept(self) -> list:
        return self._with(Outcome.KEPT)

    @property
    def failed(self) -> list:
        return self._with(Outcome.FAILED)

    @property
    def nccl_bytes(self) -> int:
        """NCCL's suspendable bytes of the groups this transition moved."""
        moved = (Outcome.SUSPENDED, Outcome.RESUMED)
        return sum(g.suspendable_bytes or 0 for g in self.groups if g.action in moved)

    @property
    def device_freed_bytes(self) -> Optional[int]:
        """Device free memory gained (begin) or given back (end, negative)."""
        if self.device_free_before is None or self.device_free_after is None:
            return None
        return self.device_free_after - self.device_free_before

    @property
    def host_rss_delta(self) -> Optional[int]:
        if self.host_rss_before is None or self.host_rss_after is None:
            return None
        return self.host_rss_after - self.host_rss_before

    def as_dict(self, prefix: str = "amem/") -> dict:
        """Flat numbers for framework loggers (wandb, tensorboard, trainer.log)."""
        p = f"{prefix}{self.kind}/"
        out = {
            p + "groups_suspended": len(self.suspended) if self.kind is Kind.BEGIN else 0,
            p + "groups_resumed": len(self._with(Outcome.RESUMED)),
            p + "groups_kept": len(self.kept),
            p + "groups_failed": len(self.failed),
            p + "nccl_bytes": self.nccl_bytes,
            p + "seconds": self.total_seconds,
            p + "agree_seconds": self.agree_seconds,
            p + "wall_seconds": self.wall_seconds,
        }
        if self.kind is Kind.BEGIN:
            out[p + "held_seconds"] = self.held_seconds
            if self.waited_for_bytes is not None:
                out[p + "waited_for_bytes"] = self.waited_for_bytes
        if self.device_freed_bytes is not None:
            # device-wide when the GPU is shared: the key says so
            shared = "device_freed_bytes" if self.device_shared_by <= 1 else \
                "gpu_wide_freed_bytes"
            out[p + shared] = self.device_freed_bytes
            out[p + "ranks_on_this_gpu"] = self.device_shared_by
        if self.host_rss_delta is not None:
            out[p + "host_rss_delta_bytes"] = self.host_rss_delta
        out[p + "groups_learned_kept"] = len(self.learned)
        for g in self.groups:
            if g.action in (Outcome.SUSPENDED, Outcome.RESUMED, Outcome.FAILED):
                out[f"{p}group/{g.name}/seconds"] = g.seconds
                out[f"{p}group/{g.name}/bytes"] = g.suspendable_bytes or 0
                out[f"{p}group/{g.name}/stays_bytes"] = g.stays_bytes
        return out

    def summary(self) -> str:
        """One log line."""
        if self.skipped:
            return f"{self.kind}({self.phase!r}): nothing done: {self.skipped}"
        if self.pending:
            verb = "suspending" if self.kind is Kind.BEGIN else "resuming"
            if self.kind is Kind.BEGIN and self.hold_s > 0:
                verb = f"holding (up to {self.hold_s:g} s, until the caller lets them start)"
            return (f"{self.kind}({self.phase!r}) via {self.backend}: {verb} {self.planned} in "
                    f"the background; kept {len(self.kept)}")
        parts = [f"{self.kind}({self.phase!r}) via {self.backend}:"]
        for action in (Outcome.SUSPENDED, Outcome.RESUMED, Outcome.WOULD_SUSPEND,
                       Outcome.WOULD_RESUME, Outcome.FAILED):
            names = [g.name for g in self._with(action)]
            if names:
                parts.append(f"{action} {names}")
        if self.kept:
            parts.append(f"kept {len(self.kept)}")
        parts.append(f"NCCL {self.nccl_bytes / 2**20:.0f} MiB")
        if self.device_freed_bytes is not None:
            shared = (f" (whole GPU, {self.device_shared_by} ranks share it)"
                      if self.device_shared_by > 1 else "")
            parts.append(f"device free {self.device_freed_bytes / 2**20:+.0f} MiB{shared}")
        stays = sum(g.stays_bytes for g in self.groups if g.action is Outcome.SUSPENDED)
        if stays:
            parts.append(f"{stays / 2**20:.0f} MiB stay (persistent or unreached)")
        parts.append(f"in {self.total_seconds:.3f} s")
        if self.held_seconds:
            parts.append(f"(held {self.held_seconds:.3f} s first)")
        return " ".join(parts)


@dataclass
class Counters:
    """Cumulative figures over the life of a policy.

    Written from the caller's thread and from the transition worker's pool at
    once (NCCL calls release the GIL, so the threads really interleave): every
    change goes through :meth:`add` or :meth:`record_freed`, under one lock, since
    ``counters.x += 1`` from two threads can lose a count."""

    begins: int = 0
    ends: int = 0
    group_suspends: int = 0
    group_resumes: int = 0
    #: a dry run (noop backend) counts here, never as suspends or resumes
    would_suspends: int = 0
    would_resumes: int = 0
    auto_resumes: int = 0
    #: seconds callers spent held by the guard until their group was back
    guard_wait_seconds: float = 0.0
    failures: int = 0
    transition_seconds: float = 0.0
    last_device_freed_bytes: int = 0
    max_device_freed_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    #: group name -> [calls the guard held back, their seconds]: which group the step after
    #: a phase waits for (``guard_wait_seconds`` is their sum)
    _guard_waits: dict = field(default_factory=dict, repr=False, compare=False)

    def add(self, name: str, amount=1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def record_freed(self, nbytes: int) -> None:
        """The device bytes one begin freed: the last, and the most so far."""
        with self._lock:
            self.last_device_freed_bytes = nbytes
            self.max_device_freed_bytes = max(self.max_device_freed_bytes, nbytes)

    def record_guard_wait(self, group_name: str, seconds: float) -> None:
        """A call the guard held back ``seconds`` until its group was usable."""
        with self._lock:
            self.guard_wait_seconds += seconds
            row = self._guard_waits.setdefault(group_name, [0, 0.0])
            row[0] += 1
            row[1] += seconds

    def as_dict(self, prefix: str = "amem/") -> dict:
        with self._lock:
            out = {f"{prefix}total/{f.name}": getattr(self, f.name) for f in fields(self)
                   if not f.name.startswith("_")}
            for name, (calls, seconds) in sorted(self._guard_waits.items()):
                out[f"{prefix}guard_wait/{name}/calls"] = calls
                out[f"{prefix}guard_wait/{name}/seconds"] = seconds
            return out


def write_scalars(metrics: dict, tensorboard=None, wandb=None, step: int = 0) -> None:
    """Flat figures to a tensorboard writer (``add_scalar``) and a wandb run (``log``);
    either may be None."""
    if tensorboard is not None:
        for name, value in metrics.items():
            tensorboard.add_scalar(name, value, step)
    if wandb is not None:
        wandb.log(metrics, step)


def merge_rank_metrics(per_rank) -> dict:
    """Every rank's flat figures as one per key: the slowest rank for times
    (``...seconds``), else the mean."""
    per_rank = [m for m in per_rank or [] if m]
    out = {}
    for key in sorted({k for m in per_rank for k in m}):
        values = [float(m[key]) for m in per_rank if key in m]
        out[key] = max(values) if key.endswith("seconds") else sum(values) / len(values)
    return out
