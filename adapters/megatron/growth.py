"""``KvCacheGrowth``: each rollout starts at once on the launch-size KV cache; where the
decision says growing pays, the cache (and the requests it runs at once) grows into
the freed memory at the first step boundary after the suspends are over. Every rank
of a model replica (the engine's ``mp`` group) agrees over the c10d store, never NCCL,
at the resume and at fixed step counts (docs/megatron.md, "Growing the KV cache")."""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Callable, Optional

from amem_callbacks.availability import is_distributed_initialized, loaded_torch
from amem_callbacks.log import logger

from . import concurrency, kv_cache
from .decision import Decision, GrowthDecider, RolloutFigures, combine
from .kv_cache import KvCacheReport, Launch, Size, why_not_growable
from .meter import RolloutMeter
from .regrow import regrow, why_not_now

#: with a replica of several ranks, they compare progress every this many steps (a
#: store round each); a replica of one rank looks at its own progress every step
POLL_EVERY = 8


def replica_ranks(engine) -> list:
    if not is_distributed_initialized():
        return [0]
    dist = loaded_torch().distributed
    mp = getattr(getattr(engine, "pg_collection", None), "mp", None)
    return sorted(dist.get_process_group_ranks(mp)) if mp is not None else [dist.get_rank()]


def why_not_mid_rollout(engine) -> Optional[str]:
    """None when the cache can grow between steps (every rank that steps with this one
    is in its replica), else why not."""
    if concurrency.ep_size(engine) > 1:
        return ("expert parallelism: the expert-parallel peers of other replicas step with "
                "this engine, so it grows only where the memory is free at its resume")
    return None


class KvCacheGrowth:
    """Sizes, grows and measures each rollout's KV cache. ``exchange(name, value,
    ranks) -> ({rank: value}, missing)``: the session's store exchange (bounded)."""

    def __init__(self, margin_bytes: int, exchange, *, decider: Optional[GrowthDecider] = None,
                 poll_every: int = POLL_EVERY, clock: Callable[[], float] = time.monotonic):
        self.margin_bytes = margin_bytes
        self.decider = decider or GrowthDecider()
        self.poll_every = poll_every
        self.clock = clock
        self.reports: collections.deque = collections.deque(maxlen=16)  # KvCacheReport
        self.measured: collections.deque = collections.deque(maxlen=16)  # this rank's figures
        self.decisions: collections.deque = collections.deque(maxlen=16)
        self._exchange = exchange
        self._launch: dict = {}  # id(context) -> Launch
        self._meter: Optional[RolloutMeter] = None
        self._previous: Optional[RolloutFigures] = None  # shared at the next resume
        self._waiting = False  # grow once every rank's suspends are over
        self._polls = 0
        self._grown = False
        self._resume_s = 0.0
        self._warned = False
        self.decision: Optional[Decision] = None  # this rollout's, once its resume decided

    @property
    def waiting(self) -> bool:
        """This rollout grows once every rank's suspends are over."""
        return self._waiting

    @property
    def grown(self) -> bool:
        """The cache holds freed memory now (it must be given back before NCCL's resume)."""
        return self._grown

    # --- the rollout's boundaries --------------------------------------------
    def rollout_started(self, engine=None) -> None:
        """A rollout begins: measure it (once, whichever seam comes first)."""
        if self._meter is None:
            self._meter = RolloutMeter(getattr(engine, "evicted_request_count", 0),
                                       clock=self.clock)

    def before_resume(self, engine, session) -> KvCacheReport:
        """Collective over the replica (store): the engine is about to allocate this
        rollout's cache. Decide, size, apply that size, report: each once (the launch
        size, or, where every rank's suspends are already over, the grown one)."""
        context = engine.context
        why = why_not_growable(context)
        if why is not None:
            if not self._warned:
                self._warned = True
                logger.warning("amem_callbacks: --rl-amem-grow-kv-cache does nothing here: %s", why)
            self._meter = None  # nothing to decide: nothing measured
            return self._report(engine, Sized(None, None, why))
        self.rollout_started(engine)
        launch = self._launch.setdefault(id(context), Launch.of(engine))
        sized = self._size_at_resume(engine, launch, session.freed())
        kv_cache.apply(engine, launch, sized.size)
        self._grown = sized.grown
        return self._report(engine, sized)

    def _size_at_resume(self, engine, launch: Launch, freed) -> "Sized":
        """The decision and the size it gives at the resume (nothing applied yet)."""
        self.decision = None
        shared = self._share(engine, "resume", {
            "figures": None if self._previous is None else self._previous.to_json(),
            "done": freed.done, "freed": freed.nbytes})
        self._previous = None
        at_launch = Sized(launch, launch.size, "", freed.nbytes)
        if shared is None:
            return at_launch.because("a rank of this replica did not report at the resume: "
                                     "launch size")
        previous = [v["figures"] for v in shared]
        if all(previous):
            self.decider.record(combine([RolloutFigures.from_json(f) for f in previous]))
        decision = self.decision = self.decider.choose(self._regrow_cost())
        self._announce(decision)
        extra = min(v["freed"] for v in shared) - self.margin_bytes
        if decision.grow and extra > 0 and all(v["done"] for v in shared):
            size = launch.grown_by(engine.context, extra)
            if self._all_have_room(engine, launch, size, held_bytes=0):
                return Sized(launch, size, "", freed.nbytes, extra, "resume", grown=True)
            return at_launch.because("a rank of this replica has no room for it", extra)
        if not decision.grow:
            return at_launch.because(decision.why)
        later = why_not_mid_rollout(engine)
        self._waiting = later is None
        return at_launch.because(later or "the suspends are still running: it grows once they "
                                 "are over")

    def resumed(self, seconds: float) -> None:
        """The engine's own resume took ``seconds`` (what a regrow costs at least)."""
        self._resume_s = seconds

    def before_step(self, engine, session) -> Optional[KvCacheReport]:
        """Between two engine steps: grow once every rank's suspends are over.
        Collective over the replica (store) every ``poll_every`` steps while waiting."""
        if self._meter is None:
            return None
        self._meter.step_begins()
        if not self._waiting:
            return None
        self._polls += 1
        ranks = replica_ranks(engine)
        if len(ranks) > 1 and self._polls % self.poll_every:
            return None
        freed = session.freed()
        if len(ranks) == 1:
            progress = [{"done": freed.done, "freed": freed.nbytes}]
        else:
            progress = self._share(engine, "ready", {"done": freed.done, "freed": freed.nbytes})
            if progress is None:  # a peer is late or gone: grow nothing rather than diverge
                self._waiting = False
                return None
        if not all(p["done"] for p in progress) or why_not_now(engine) is not None:
            return None
        self._waiting = False
        return self._grow_now(engine, freed.nbytes, min(p["freed"] for p in progress))

    def after_step(self, engine, result) -> None:
        if self._meter is not None:
            self._meter.step_ended(engine, result)

    def at_end(self, engine, session) -> Optional[RolloutFigures]:
        """The rollout is over (the engine suspends): its figures, shared at the next
        resume; the cache's extra blocks go back with the engine's suspend."""
        meter, self._meter = self._meter, None
        self._waiting, self._polls, self.decision = False, 0, None
        grown, self._grown = self._grown, False
        if meter is None or engine is None:
            return None
        freed = session.freed()
        figures = meter.finish(engine, grown=grown, ready_at=freed.done_at,
                               resume_s=self._resume_s)
        figures.room_bytes = freed.nbytes - self.margin_bytes
        self._resume_s = 0.0
        self._previous = figures
        self.measured.append(figures)
        logger.info("amem_callbacks: rollout measured: %d tokens in %.2f s (%.0f tokens/s), "
                    "first token %.2f s after its start, %d of %d steps short of room, %d "
                    "evictions, up to %d of %d requests at once, %s", figures.tokens,
                    figures.seconds, figures.tokens_per_s, figures.first_token_s,
                    figures.bound_steps, figures.steps, figures.evictions,
                    figures.peak_requests, figures.max_requests,
                    f"grown (regrow {figures.regrow_s:.2f} s)" if grown else "launch size")
        return figures

    # --- internals ---------------------------------------------------------------
    def _grow_now(self, engine, freed_here: int, agreed_freed: int) -> KvCacheReport:
        """Size, then regrow (the engine's own suspend and resume around the apply),
        then report: each once."""
        launch = self._launch[id(engine.context)]
        sized = self._size_mid_rollout(engine, launch, freed_here, agreed_freed)
        if not sized.grown:
            return self._report(engine, sized)
        seconds = regrow(engine, lambda: kv_cache.apply(engine, launch, sized.size), self.clock)
        self._meter.add_regrow(seconds)
        self._grown = True
        report = self._report(engine, sized)
        report.regrow_s = seconds
        return report

    def _size_mid_rollout(self, engine, launch: Launch, freed_here: int,
                          agreed_freed: int) -> "Sized":
        extra = agreed_freed - self.margin_bytes
        if extra <= 0:
            return Sized(launch, None, "the freed memory is less than the margin", freed_here)
        size = launch.grown_by(engine.context, extra)
        if not self._all_have_room(engine, launch, size, launch.bytes_of(launch.size)):
            return Sized(launch, None, "a rank of this replica has no room for it", freed_here,
                         extra)
        return Sized(launch, size, "", freed_here, extra,
                     f"step {self._meter.figures.steps + 1}", grown=True)

    def _regrow_cost(self) -> float:
        """What growing mid-rollout is expected to cost, from agreed figures: the last
        regrow, else the engine's own resume (a regrow is one more)."""
        grown, latest = self.decider.grown, self.decider.latest
        if grown is not None and grown.regrow_s > 0:
            return grown.regrow_s
        return latest.resume_s if latest is not None else 0.0

    def _all_have_room(self, engine, launch: Launch, size: Size, held_bytes: int) -> bool:
        room = kv_cache.has_room(launch, size, held_bytes)
        if len(replica_ranks(engine)) == 1:
            return room
        shared = self._share(engine, "room", {"room": room})
        return shared is not None and all(v["room"] for v in shared)

    def _share(self, engine, topic: str, value: dict) -> Optional[list]:
        """Collective over the replica (store): every rank's ``value``, in rank order;
        None when a rank did not report in time."""
        ranks = replica_ranks(engine)
        if len(ranks) == 1:
            return [value]
        # One name per replica and topic; the store agreement numbers the rounds.
        values, missing = self._exchange(f"kv_cache/{topic}/{ranks[0]}", json.dumps(value), ranks)
        if missing:
            logger.warning("amem_callbacks: rank(s) %s of this model replica did not report "
                           "(%s); the KV cache keeps its launch size", missing, topic)
            return None
        return [json.loads(values[r]) for r in ranks]

    def _announce(self, decision: Decision) -> None:
        self.decisions.append(decision)
        logger.info("amem_callbacks: KV growth for this rollout: %s (%s)",
                    "grow" if decision.grow else "launch size", decision.why)

    def _report(self, engine, sized: "Sized") -> KvCacheReport:
        """What the context holds now, beside the decision's size and why."""
        context, launch = engine.context, sized.launch
        allocator = getattr(context, "kv_block_allocator", None)
        blocks = getattr(allocator, "total_count", 0)
        report = KvCacheReport(
            grown=sized.grown, why=sized.why, blocks=blocks,
            base_blocks=launch.size.blocks if launch else blocks,
            block_bytes=getattr(context, "block_size_bytes", 0),
            block_tokens=getattr(context, "block_size_tokens", 0),
            max_requests=getattr(context, "max_requests", 0),
            launch_max_requests=launch.size.max_requests if launch else getattr(
                context, "max_requests", 0),
            freed_bytes=sized.freed, margin_bytes=self.margin_bytes,
            agreed_extra_bytes=max(0, sized.extra), when=sized.when,
            fixed_why=(launch.fixed or "") if launch else "")
        if self._meter is not None and sized.grown:
            report.after_s = self.clock() - self._meter.started
        self.reports.append(report)
        return report


@dataclass(frozen=True)
class Sized:
    """A decision's outcome before it is applied: the size to install (None: leave the
    cache as it is), whether it is the grown one, why not, and the figures reported."""

    launch: Optional[Launch]
    size: Optional[Size]
    why: str
    freed: int = 0
    extra: int = 0
    when: str = ""
    grown: bool = False

    def because(self, why: str, extra: int = 0) -> "Sized":
        return dataclasses.replace(self, why=why, extra=extra)
