"""Fair with/without comparisons: runs interleaved in pairs, ratios per pair.

A shared GPU drifts (clocks, other tenants, caches warming up), and whichever
configuration always runs first is biased. So every comparison here runs
pairs back to back, alternating which side leads (A B, B A, A B, ...), takes
the ratio inside each pair, and reports the median ratio with its spread,
never the best pair. A control (the baseline again, or a configuration that
must fail) runs once after the pairs.

Example:
    >>> result = interleaved({"without": run_plain, "with": run_amem}, pairs=3,
    ...                      control=("control", run_plain_big_kv))
    >>> result.ratio("step_s")       # with / without, median of pairs
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class Pair:
    index: int
    order: tuple  # which side ran first
    results: dict  # side -> whatever its run returned (a dict of figures)
    seconds: dict  # side -> wall time of the run


@dataclass
class Interleaved:
    sides: tuple  # (baseline side, compared side)
    pairs: list = field(default_factory=list)
    control: Optional[dict] = None

    def values(self, side: str, key: str) -> list:
        return [p.results[side].get(key) for p in self.pairs]

    def ratios(self, key: str) -> list:
        """compared / baseline for ``key`` in each pair where both have it."""
        base, other = self.sides
        out = []
        for p in self.pairs:
            a, b = p.results[base].get(key), p.results[other].get(key)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a:
                out.append(b / a)
        return out

    def ratio(self, key: str) -> Optional[float]:
        ratios = self.ratios(key)
        return statistics.median(ratios) if ratios else None

    def spread(self, key: str) -> Optional[list]:
        ratios = self.ratios(key)
        return [min(ratios), max(ratios)] if ratios else None

    @classmethod
    def from_dict(cls, data: dict) -> "Interleaved":
        """The inverse of :meth:`as_dict` (a result read back from JSON)."""
        return cls(sides=tuple(data["sides"]), control=data.get("control"), pairs=[
            Pair(p["index"], tuple(p["order"]), p["results"], p["wall_s"]) for p in data["pairs"]])

    def as_dict(self) -> dict:
        return {"sides": list(self.sides),
                "pairs": [{"index": p.index, "order": list(p.order), "results": p.results,
                           "wall_s": p.seconds} for p in self.pairs],
                "control": self.control}


class MixedCommits(ValueError):
    """Records made with different code, merged as if they were one experiment."""


def one_commit(commits: dict, why: Optional[str] = None) -> Optional[str]:
    """The one commit of the records ``{name: commit}`` a merge folds together.

    A ratio between two runs means something only if the same code made both: a
    merge of records whose commits differ stops here, naming them, unless ``why``
    says why they may be folded (a change that touches no code the runs execute);
    the merge then keeps that reason beside its figures. Where some records carry
    a commit and others none, those are named, never taken for a match; where none
    does (records older than the commit field), there is nothing to hold: None."""
    known = {name: commit for name, commit in commits.items() if commit}
    missing = sorted(name for name, commit in commits.items() if not commit)
    distinct = sorted(set(known.values()))
    if not known or (len(distinct) == 1 and not missing):
        return distinct[0] if distinct else None
    if why:
        return None
    by_commit = {c: sorted(n for n, k in known.items() if k == c) for c in distinct}
    raise MixedCommits(
        f"these records were not made by one commit: {by_commit}"
        + (f"; no commit in {missing}" if missing else "")
        + ": re-run them at one commit, or pass the reason they may be merged "
          "(--mixed-commits-why TEXT)")


def interleaved(runs: dict, pairs: int = 3, control: Optional[tuple] = None,
                progress: Callable = None) -> Interleaved:
    """Run the two sides of ``runs`` (``{"without": fn, "with": fn}``, baseline
    first) ``pairs`` times, alternating which leads; then ``control``
    (``(name, fn)``) once. Each ``fn(index)`` returns a dict of figures."""
    if len(runs) != 2:
        raise ValueError(f"interleaved compares two sides, got {list(runs)}")
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    sides = tuple(runs)
    out = Interleaved(sides=sides)
    for index in range(pairs):
        order = sides if index % 2 == 0 else sides[::-1]
        results, seconds = {}, {}
        for side in order:
            if progress:
                progress(f"pair {index + 1}/{pairs}: {side}")
            start = time.monotonic()
            results[side] = runs[side](index)
            seconds[side] = time.monotonic() - start
        out.pairs.append(Pair(index, order, results, seconds))
    if control is not None:
        name, fn = control
        if progress:
            progress(f"control: {name}")
        start = time.monotonic()
        out.control = {"name": name, "result": fn(pairs), "wall_s": time.monotonic() - start}
    return out
