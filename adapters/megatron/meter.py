"""What one rollout did on this rank, step by step, for the growth decision: tokens and
time, whether requests waited for room, evictions, how many ran at once."""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

from .decision import RolloutFigures


def tokens_of(result) -> int:
    """Requests that ran in a step, each of which produced a token: the step's
    still-active and finished requests (``async_step``'s result, 0.16 to 0.19)."""
    if not isinstance(result, dict):
        return 0
    return len(result.get("active_request_ids") or ()) + len(
        result.get("finished_request_records") or ())


def short_of_room(engine) -> bool:
    """After a step: a request is paused, or waits while the engine is full (as many
    requests as ``max_requests``, or too few free blocks for the head request)."""
    context = engine.context
    if getattr(context, "paused_request_count", 0) > 0:
        return True
    waiting = getattr(engine, "waiting_request_ids", None)
    if not waiting:
        return False
    if getattr(context, "total_request_count", 0) >= getattr(context, "max_requests", 0):
        return True
    free = getattr(getattr(context, "kv_block_allocator", None), "total_avail", None)
    if free is None:
        return False
    try:
        head = engine.get_request(waiting[0])
        tokens = len(head.remaining_prompt_tokens)
    except Exception:  # an engine without these names: one block is the least it needs
        tokens = 1
    return free < max(1, math.ceil(tokens / max(1, getattr(context, "block_size_tokens", 1))))


class RolloutMeter:
    """Started when a rollout starts; every engine step reports to it; ``finish``
    returns the figures. ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, engine_evictions: int = 0, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self.figures = RolloutFigures()
        self._evictions_at_start = engine_evictions
        self._first_step: Optional[float] = None
        self._first_token: Optional[float] = None  # the end of the first step with tokens
        self._last_step_end: Optional[float] = None

    def step_begins(self) -> None:
        if self._first_step is None:
            self._first_step = self.clock()

    def step_ended(self, engine, result) -> None:
        figures = self.figures
        figures.steps += 1
        tokens = tokens_of(result)
        figures.tokens += tokens
        figures.bound_steps += int(short_of_room(engine))
        figures.peak_requests = max(figures.peak_requests,
                                    getattr(engine.context, "total_request_count", 0))
        self._last_step_end = self.clock()
        if tokens and self._first_token is None:
            self._first_token = self._last_step_end

    def add_regrow(self, seconds: float) -> None:
        self.figures.regrow_s += seconds

    def finish(self, engine, *, grown: bool, ready_at: Optional[float],
               resume_s: float) -> RolloutFigures:
        """The figures; ``ready_at``: when this rank's suspends were over (the clock's
        time), None while they still run."""
        figures = self.figures
        figures.grown = grown
        figures.resume_s = resume_s
        figures.max_requests = getattr(engine.context, "max_requests", 0)
        figures.evictions = max(0, getattr(engine, "evicted_request_count", 0)
                                - self._evictions_at_start)
        if self._first_step is not None:
            end = self._last_step_end if self._last_step_end is not None else self._first_step
            figures.first_step_s = self._first_step - self.started
            first_token = self._first_token if self._first_token is not None else end
            figures.first_token_s = first_token - self.started
            figures.seconds = max(0.0, end - self._first_step)
            figures.span_s = end - self.started
        figures.ready_s = None if ready_at is None else max(0.0, ready_at - self.started)
        return figures
