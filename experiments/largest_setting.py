"""The largest setting that runs: the yardstick of every with/without comparison.

A comparison of the package against running without it means something only
against the best a user can run without it: the largest KV share (vLLM's
``gpu_memory_utilization``) or KV buffer (Megatron's) that still fits. Both sides
are found by the same search on the same grid (``low + k * step``), on the same
machine: without the package, then with it.

The search bisects the grid, assuming that every setting below one that fits
fits too, and every setting above one that failed fails: it runs the middle of
the settings no run has decided yet, directly or so, until none is left. A grid
of six settings takes three runs, not the five of trying both ends first (each
run of the real jobs is minutes of a GPU). The answer is always a setting that
ran: ``low`` runs only when everything above it failed, and the largest fit
found has its upper neighbour seen failing, or is the grid's top. A run that
neither fitted nor ran out of memory (cut by a time bound, a crash) says nothing
about fitting: it is tried again once, then the search stops and says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

#: a setting whose run said nothing about fitting is tried this often in all
TRIES = 2


@dataclass
class Search:
    low: float
    step: float
    high: float
    #: setting -> list of outcomes: True (fits), False (out of memory), None (neither)
    trials: dict = field(default_factory=dict)

    def __post_init__(self):
        if not (self.step > 0 and self.high >= self.low):
            raise ValueError(f"a search needs step > 0 and high >= low, got low {self.low}, "
                             f"step {self.step}, high {self.high}")

    @property
    def grid(self) -> list:
        count = int(round((self.high - self.low) / self.step))
        return [self.value(k) for k in range(count + 1)]

    def value(self, k: int) -> float:
        return round(self.low + k * self.step, 6)

    def record(self, value: float, fits: Optional[bool]) -> None:
        self.trials.setdefault(self.value(self.index(value)), []).append(fits)

    def index(self, value: float) -> int:
        k = int(round((value - self.low) / self.step))
        if abs(self.value(k) - value) > 1e-6 * max(1.0, abs(value)):
            raise ValueError(f"{value} is not on the grid {self.low} + k * {self.step}")
        return k

    def outcome(self, value: float) -> Optional[bool]:
        """True or False once a run decided it, else None."""
        decided = [t for t in self.trials.get(value, []) if t is not None]
        return decided[-1] if decided else None

    @property
    def largest_fit(self) -> Optional[float]:
        fits = [v for v in self.grid if self.outcome(v) is True]
        return max(fits) if fits else None

    @property
    def smallest_fail(self) -> Optional[float]:
        fails = [v for v in self.grid if self.outcome(v) is False]
        return min(fails) if fails else None

    def stuck(self) -> Optional[str]:
        """Why the search cannot go on, else None."""
        for value, outcomes in self.trials.items():
            if self.outcome(value) is None and len(outcomes) >= TRIES:
                return (f"{value} neither fitted nor ran out of memory in {len(outcomes)} runs: "
                        "the search cannot tell which side of the edge it is on")
        if self.outcome(self.low) is False:
            return f"the lowest setting {self.low} does not fit: lower the search's low"
        fit, fail = self.largest_fit, self.smallest_fail
        if fit is not None and fail is not None and fail < fit:
            return (f"{fail} failed below {fit}, which fitted: this machine does not fit "
                    "monotonically (another tenant, a leak); re-run both")
        return None

    def implied(self, value: float) -> Optional[bool]:
        """What the runs say of ``value``, its own or by a neighbour: fits where a larger
        setting fitted, fails where a smaller one failed, else its own outcome."""
        fit, fail = self.largest_fit, self.smallest_fail
        if fit is not None and value <= fit:
            return True
        if fail is not None and value >= fail:
            return False
        return self.outcome(value)

    def next(self) -> Optional[float]:
        """The next setting to run, or None when the search is over (or stuck)."""
        if self.stuck():
            return None
        # the undecided settings lie between the largest fit and the smallest failure
        open_ = [k for k, value in enumerate(self.grid) if self.implied(value) is None]
        if not open_:
            return None
        return self.value((open_[0] + open_[-1]) // 2)

    def done(self) -> bool:
        return self.next() is None

    def as_dict(self) -> dict:
        return {"low": self.low, "step": self.step, "high": self.high,
                "trials": {str(v): outcomes for v, outcomes in sorted(self.trials.items())},
                "largest_fit": self.largest_fit, "smallest_fail": self.smallest_fail,
                "grid_top_fits": self.outcome(self.high) is True, "stuck": self.stuck(),
                "done": self.done()}

    @classmethod
    def from_dict(cls, data: dict) -> "Search":
        return cls(data["low"], data["step"], data["high"],
                   {float(v): list(outcomes) for v, outcomes in data["trials"].items()})
