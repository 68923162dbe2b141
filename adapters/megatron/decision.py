"""Whether growing the KV cache pays, decided from measured rollouts (docs/megatron.md,
"Growing only where it pays").

Pure bookkeeping, no torch: every rank of a model replica feeds it the same agreed
figures (``combine``), in the same order, so every rank reaches the same decision.
A rollout either grows (the freed memory joins the cache once the suspends are over)
or runs at the launch size, which costs what a run without growth costs. The two are
compared on the rollout's generation rate; the better one is kept and the other one is
measured again only after ``hold`` rollouts, a hold that doubles each time the same one
wins again, so the choice settles and cannot flip every rollout. Where the launch size's
only figure is the first rollout the decider saw (a process's first carries its warm-up),
growth that beats it is checked against the launch size once more right after the probe.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

GROW, SKIP = "grow", "skip"
#: growth must beat the launch size by this much to be chosen (noise between rollouts)
MIN_GAIN = 0.05
FIRST_HOLD = 2
MAX_HOLD = 32


@dataclasses.dataclass
class RolloutFigures:
    """One rollout as one rank measured it (times from the rollout's start)."""

    grown: bool = False  # the cache had grown blocks for part of the rollout
    tokens: int = 0  # tokens the engine produced (one per request and step)
    seconds: float = 0.0  # first step's start to last step's end
    span_s: float = 0.0  # rollout start to the last step's end
    steps: int = 0
    bound_steps: int = 0  # steps that ended with a request waiting for room, or paused
    evictions: int = 0
    peak_requests: int = 0  # most requests the engine ran at once
    max_requests: int = 0  # how many it could run at once at the end
    first_step_s: float = 0.0  # rollout start to the first step's start
    first_token_s: float = 0.0  # rollout start to the end of the first step that made tokens
    ready_s: Optional[float] = None  # rollout start to the end of this rank's suspends
    regrow_s: float = 0.0  # the mid-rollout suspend, resize and resume
    resume_s: float = 0.0  # the engine's own resume (allocation, graph capture)
    room_bytes: int = 0  # what the suspends freed here, less the margin

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def bound(self) -> bool:
        """More room could have run more requests at once."""
        return self.bound_steps > 0 or self.evictions > 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RolloutFigures":
        return cls(**json.loads(text))

    def as_dict(self, prefix: str = "amem/kv_cache/measured/") -> dict:
        out = {name: value for name, value in dataclasses.asdict(self).items()
               if value is not None}
        out["grown"] = int(self.grown)
        out["tokens_per_s"] = self.tokens_per_s
        return {prefix + name: value for name, value in out.items()}


def combine(figures: list) -> RolloutFigures:
    """The replica's figures from its ranks' (they run the same requests in the same
    steps; only their clocks differ): the slower clock, the later readiness."""
    readies = [f.ready_s for f in figures]
    return RolloutFigures(
        grown=all(f.grown for f in figures), tokens=min(f.tokens for f in figures),
        seconds=max(f.seconds for f in figures), span_s=max(f.span_s for f in figures),
        steps=min(f.steps for f in figures), bound_steps=max(f.bound_steps for f in figures),
        evictions=max(f.evictions for f in figures),
        peak_requests=max(f.peak_requests for f in figures),
        max_requests=min(f.max_requests for f in figures),
        first_step_s=max(f.first_step_s for f in figures),
        first_token_s=max(f.first_token_s for f in figures),
        ready_s=None if any(r is None for r in readies) else max(readies),
        regrow_s=max(f.regrow_s for f in figures), resume_s=max(f.resume_s for f in figures),
        room_bytes=min(f.room_bytes for f in figures))


@dataclasses.dataclass(frozen=True)
class Decision:
    """This rollout's choice: ``grow`` or not, whether it is a probe, and why."""

    grow: bool
    why: str
    probe: bool = False

    def as_dict(self, prefix: str = "amem/kv_cache/") -> dict:
        return {prefix + "decision": int(self.grow), prefix + "decision_probe": int(self.probe)}


class GrowthDecider:
    """Chooses per rollout between growing and the launch size (see the module docstring).

    ``record`` the previous rollout's agreed figures, then ``choose`` for the next one.
    """

    def __init__(self, min_gain: float = MIN_GAIN, first_hold: int = FIRST_HOLD,
                 max_hold: int = MAX_HOLD):
        self.min_gain = min_gain
        self.first_hold = first_hold
        self.max_hold = max_hold
        self.base: Optional[RolloutFigures] = None  # latest rollout at the launch size
        self.grown: Optional[RolloutFigures] = None  # latest rollout that grew
        self.winner: Optional[str] = None
        self.hold = 0
        self.left = 0  # rollouts of the winner before the other is measured again
        self.latest: Optional[RolloutFigures] = None
        self._probing: Optional[str] = None  # the arm the last choice measured again
        #: the launch size's figure is the first rollout recorded, which in a new process
        #: carries its warm-up (compilation, first allocations): growth compared with it
        #: looks better than it is, so that figure is measured again before it counts
        self.base_is_first = False

    def record(self, figures: RolloutFigures) -> None:
        """The previous rollout's figures (the same on every rank of the replica)."""
        first = self.latest is None
        self.latest = figures
        arm = GROW if figures.grown else SKIP
        if figures.grown:
            self.grown = figures
        else:
            self.base, self.base_is_first = figures, first
        probed, self._probing = self._probing, None
        if self.base is None or self.grown is None:
            return
        better = self._better()
        if self.winner is None:
            self.winner, self.hold = better, self.first_hold
            # growth beat a warm-up figure: the launch size is measured again at once
            self.left = 0 if better == GROW and self.base_is_first else self.hold
        elif probed is not None and probed == arm:
            # the other arm was measured again: confirmed winners hold longer
            if better == self.winner:
                self.hold = min(self.max_hold, self.hold * 2)
            else:
                self.winner, self.hold = better, self.first_hold
            self.left = self.hold
        elif arm == self.winner:
            self.left -= 1

    def gain(self) -> Optional[float]:
        """Growth's generation rate over the launch size's, once both are measured."""
        if self.base is None or self.grown is None or self.base.tokens_per_s <= 0:
            return None
        return self.grown.tokens_per_s / self.base.tokens_per_s

    def _better(self) -> str:
        # Hysteresis: growth must win by min_gain to be taken, and keeps its place
        # while it still wins by half that.
        threshold = 1 + (self.min_gain / 2 if self.winner == GROW else self.min_gain)
        return GROW if (self.gain() or 0.0) >= threshold else SKIP

    def choose(self, regrow_cost_s: float = 0.0) -> Decision:
        """This rollout's decision. ``regrow_cost_s``: what growing mid-rollout is
        expected to cost (a measured regrow, else the engine's own resume)."""
        base, latest = self.base, self.latest
        if base is None:
            return Decision(False, "no rollout measured at the launch size yet")
        if latest is not None and latest.room_bytes <= 0:
            return Decision(False, "the last rollout's suspends freed no more than the margin "
                                   "on some rank of this replica: nothing to grow into")
        if not base.bound:
            return Decision(False, f"not limited by room at the launch size: in {base.steps} "
                                   "steps no request waited for room or was paused or evicted")
        if latest is not None and latest.span_s > 0 and (
                latest.ready_s is None or latest.ready_s + regrow_cost_s >= latest.span_s):
            ready = ("after its end" if latest.ready_s is None
                     else f"{latest.ready_s:.2f} s into it")
            return Decision(False, f"too short: the last rollout took {latest.span_s:.2f} s and "
                                   f"its suspends were over {ready}, with {regrow_cost_s:.2f} s "
                                   "to grow: no time left to gain")
        if self.grown is None:
            self._probing = GROW
            return Decision(True, f"probe: launch size measured {base.tokens_per_s:.0f} tokens/s "
                                  f"with {base.bound_steps} of {base.steps} steps short of room "
                                  f"and {base.evictions} evictions", probe=True)
        gain = self.gain() or 0.0
        figures = (f"growth {self.grown.tokens_per_s:.0f} vs launch size "
                   f"{base.tokens_per_s:.0f} tokens/s (x{gain:.2f})")
        if self.left <= 0:
            other = SKIP if self.winner == GROW else GROW
            self._probing = other
            why = ("measure the launch size again: its only figure is the first rollout's, "
                   "which carries the process's warm-up" if other == SKIP and self.base_is_first
                   else f"measure again after {self.hold} rollouts")
            return Decision(other == GROW, f"{why}: {figures}", probe=True)
        kept = "grow" if self.winner == GROW else "keep the launch size"
        return Decision(self.winner == GROW, f"{kept}: {figures}, next check in {self.left} "
                                             "rollout(s)")
