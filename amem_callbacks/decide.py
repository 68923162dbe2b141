"""Deciding what a transition does, apart from doing it.

Every agreement round of the package runs here, in the order every rank
reaches them: once per process the backend and the placement, then at each
``begin`` the plan. What comes out is immutable: an :class:`AgreedPlan` that
:class:`~amem_callbacks.transitions.Transitions` executes as given, and that a
test can build and inspect without threads or NCCL.

Why agree at all: ranks see slightly different inputs (memory stats, a
learned keep, a group missing), and a suspend that one member of a group
skips leaves the others waiting in NCCL's barrier forever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from .agreement import (Agreement, reason_of, shared_rounds, suspend_details, verdict_of,
                        vote_keep, vote_suspend)
from .groups import GroupInfo, discover
from .log import logger
from .memory import current_device, on_device
from .placement import Placement, exchange
from .plan import make_plan
from .states import Verdict


PROCESS_KEY = "__process__"


@dataclass(frozen=True)
class Setup:
    """What every rank agreed on at its first ``begin``."""

    backend: object
    description: str
    inert: bool  # nothing can be freed: training runs exactly as without the package
    agreement: Optional[Agreement] = None
    placement: Optional[Placement] = None
    device: Optional[int] = None
    default_group: object = None  # a new default group (re-initialised) needs a new set-up


@dataclass(frozen=True)
class Suspension:
    """One communicator to suspend, as agreed by its members."""

    info: GroupInfo
    covers: tuple  # every process group whose calls depend on it (several for AMem)
    nbytes: Optional[int]  # the members' agreed size (the order's key)
    first: bool  # resumed before the others at the end


@dataclass(frozen=True)
class AgreedPlan:
    """The agreed outcome of one ``begin`` on this rank."""

    phase: str
    suspend: tuple  # Suspension, largest first, then by key: the same order on every rank
    kept: tuple  # (GroupInfo, reason)
    agree_seconds: float = 0.0
    need_bytes: Optional[int] = None
    groups: tuple = field(default=(), repr=False)  # every GroupInfo discovered


def agree_setup(options, select_backend) -> Setup:
    """Collective over all ranks: pick a backend and agree every rank can use it."""
    import torch.distributed as dist  # light import: torch (both)
    from torch.distributed import distributed_c10d as c10d

    backend, description, inert = select_backend(options.backend, options.backend_options)
    default_group = c10d._get_default_group()
    agreement = Agreement(c10d._get_default_store(), dist.get_rank(), options.agree_timeout_s,
                          rounds=shared_rounds(default_group))
    world = tuple(range(dist.get_world_size()))
    vote = vote_keep(description) if inert else vote_suspend(backend.name)
    agreed = agreement.decide({"__backend__": (world, vote)})["__backend__"]
    if verdict_of(agreed) is not Verdict.SUSPEND:
        if not inert:
            logger.warning("amem_callbacks: not every rank can use backend %r (%s); "
                           "training runs unchanged", backend.name, reason_of(agreed))
        return Setup(backend, reason_of(agreed), True, agreement, default_group=default_group)
    device = options.device if options.device is not None else current_device()
    if hasattr(backend, "device"):
        backend.device = device
    placement = exchange(agreement, world, dist.get_rank(), device)
    return Setup(backend, description, False, agreement, placement, device, default_group)


def plan_begin(setup: Setup, options, phase: str, learned: dict) -> AgreedPlan:
    """Collective over each group's members: discover, propose, agree.

    Args:
        learned: group key -> reason, the keeps learned for ``phase``.
    """
    backend = setup.backend
    with on_device(setup.device):  # torch gives a group's communicator per current device
        groups = discover(backend, options.groups, setup.placement)
    proposals = make_plan(groups, phase, options.keep_for(phase), options.min_bytes,
                          options.host_memory_cap_bytes, backend.process_wide, backend.name,
                          learned=learned, need_bytes=options.need_bytes,
                          resume_first=options.resume_first)
    start = time.monotonic()
    if backend.process_wide:
        agreed = setup.agreement.decide({PROCESS_KEY: (_world(), _process_vote(
            groups, proposals, backend.name))})
        plan = _process_wide_plan(groups, proposals, agreed[PROCESS_KEY])
    else:
        votes = {g.key: (g.ranks, vote_suspend(backend.name, d.nbytes, d.first)
                         if d.action is Verdict.SUSPEND else vote_keep(d.reason))
                 for g, d in zip(groups, proposals)}
        plan = _per_group_plan(groups, proposals, setup.agreement.decide(votes))
    return AgreedPlan(phase=phase, suspend=plan[0], kept=plan[1],
                      agree_seconds=time.monotonic() - start, need_bytes=options.need_bytes,
                      groups=tuple(groups))


def _per_group_plan(groups, proposals, agreed: dict) -> tuple:
    suspend, kept = [], []
    for g, d in zip(groups, proposals):
        value = agreed[g.key]
        if verdict_of(value) is Verdict.SUSPEND and d.action is Verdict.SUSPEND:
            details = suspend_details(value)
            suspend.append(Suspension(g, (g.group,), details["bytes"], details["first"]))
        elif d.action is Verdict.SUSPEND:
            kept.append((g, "a peer rank refused: " + reason_of(value)))
        else:
            kept.append((g, d.reason))
    suspend.sort(key=lambda s: (-(s.nbytes or 0), s.info.key))
    return tuple(suspend), tuple(kept)


def _process_wide_plan(groups, proposals, value: str) -> tuple:
    if verdict_of(value) is not Verdict.SUSPEND:
        return (), tuple((g, d.reason if d.action is not Verdict.SUSPEND else reason_of(value))
                         for g, d in zip(groups, proposals))
    chosen = [g for g, d in zip(groups, proposals) if d.action is Verdict.SUSPEND]
    if not chosen:
        return (), tuple((g, d.reason) for g, d in zip(groups, proposals))
    world = _world()
    anchor = next(g for g in groups if len(g.ranks) == len(world))
    info = GroupInfo(group=anchor.group, key=PROCESS_KEY, name="process", ranks=world)
    nbytes = sum(g.memory.suspendable for g in chosen if g.memory)
    kept = tuple((g, d.reason) for g, d in zip(groups, proposals) if d.action is not Verdict.SUSPEND)
    return (Suspension(info, tuple(g.group for g in chosen), nbytes, False),), kept


def _process_vote(groups, proposals, backend_name: str) -> str:
    """A process-wide backend pauses all or nothing: one vote for the whole process."""
    if any(d.action is Verdict.SUSPEND for d in proposals):
        return vote_suspend(backend_name)
    reasons = [d.reason for g, d in zip(groups, proposals) if g.handle is not None]
    return vote_keep(reasons[0] if reasons else "no communicator to pause")


def _world() -> tuple:
    import torch.distributed as dist  # light import: torch

    return tuple(range(dist.get_world_size()))
