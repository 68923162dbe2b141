"""Which groups a phase suspends: a pure function of what this rank sees.

Ranks can see slightly different inputs (memory stats, a group missing), so
this is only each rank's *proposal*; :mod:`amem_callbacks.agreement` makes the
members of each group agree before anything collective happens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .states import Verdict


@dataclass(frozen=True)
class Decision:
    key: str
    name: str
    action: Verdict
    reason: str = ""
    #: suspendable bytes as this rank sees them (the agreed order uses the members' minimum)
    nbytes: Optional[int] = None
    #: the program uses it first after the phase: resume it before the others
    first: bool = False


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def make_plan(groups, phase: str, keep, min_bytes: int, host_cap: Optional[int],
              process_wide: bool, backend_name: str, learned: Optional[dict] = None,
              need_bytes: Optional[int] = None, resume_first=()) -> list:
    """One :class:`Decision` per group, in the order of ``groups``.

    Args:
        groups: :class:`~amem_callbacks.groups.GroupInfo` list (sorted by key).
        keep: names the phase leaves active.
        min_bytes: groups with less suspendable memory stay active (a transition
            costs hundreds of ms whatever the size).
        host_cap: most bytes NCCL may copy to pinned host memory in total.
        process_wide: the backend cannot keep single groups (AMem).
        learned: group key -> reason, for keeps learned from guard resumes.
        need_bytes: suspend only the fewest groups, largest first, that cover
            this many bytes; the others stay active as "not needed".
        resume_first: names of groups to resume before the others at the end.
    """
    learned = learned or {}
    decisions = []
    seen_handles = {}
    host_total = 0
    for info in groups:
        def keep_because(reason, info=info):
            decisions.append(Decision(info.key, info.name, Verdict.KEEP, reason))

        if info.matches(keep):
            keep_because(f"kept active for phase {phase!r}")
        elif info.key in learned:
            keep_because(learned[info.key])
        elif info.handle is None:
            keep_because(info.why_no_handle or "no communicator")
        elif info.memory_error:
            keep_because(f"NCCL memory stats failed: {info.memory_error}")
        elif info.memory is not None and info.memory.suspended:
            keep_because("already suspended outside this policy")
        elif info.memory is not None and info.memory.suspendable < min_bytes:
            keep_because(f"suspendable memory {_mib(info.memory.suspendable)} "
                         f"< min_bytes {_mib(min_bytes)}")
        elif _handle_key(info.handle) in seen_handles:
            keep_because(f"shares its communicator with {seen_handles[_handle_key(info.handle)]}")
        elif (host_cap is not None and info.memory is not None
              and host_total + info.memory.suspendable > host_cap):
            keep_because(f"host memory cap {_mib(host_cap)} would be exceeded "
                         f"({_mib(host_total)} already planned)")
        else:
            seen_handles[_handle_key(info.handle)] = info.name
            if info.memory is not None:
                host_total += info.memory.suspendable
            decisions.append(Decision(info.key, info.name, Verdict.SUSPEND,
                                      nbytes=info.memory.suspendable if info.memory else None,
                                      first=info.matches(resume_first)))
    if need_bytes is not None and not process_wide:
        decisions = _only_what_is_needed(decisions, need_bytes)

    if process_wide:
        kept_nccl = [d.name for d, g in zip(decisions, groups)
                     if d.action is Verdict.KEEP and g.handle is not None
                     and (g.matches(keep) or g.key in learned)]
        if kept_nccl:
            reason = (f"backend {backend_name!r} pauses every communicator of the process, so it "
                      f"cannot keep {kept_nccl} active; use backend='nccl' or an empty keep list")
            decisions = [Decision(d.key, d.name, Verdict.KEEP,
                                  d.reason if d.action is Verdict.KEEP else reason)
                         for d in decisions]
    return decisions


def _only_what_is_needed(decisions: list, need_bytes: int) -> list:
    """Keep every suspend past the largest ones that already cover ``need_bytes``:
    fewer communicators to move means a shorter transition."""
    candidates = sorted((d for d in decisions if d.action is Verdict.SUSPEND),
                        key=lambda d: (-(d.nbytes or 0), d.key))
    chosen, covered = set(), 0
    for d in candidates:
        if covered >= need_bytes:
            break
        chosen.add(d.key)
        covered += d.nbytes or 0
    names = [d.name for d in candidates if d.key in chosen]
    return [d if d.action is not Verdict.SUSPEND or d.key in chosen else
            Decision(d.key, d.name, Verdict.KEEP,
                     f"not needed: the phase needs {_mib(need_bytes)}, "
                     f"covered by {names} ({_mib(covered)})", nbytes=d.nbytes)
            for d in decisions]


def _handle_key(handle):
    """ncclComm_t values compare by address; other handles by identity."""
    handle = getattr(handle, "identity", handle)
    return handle if isinstance(handle, int) else id(handle)
