"""Learned keep-sets: a group the guard had to resume during a phase stays
active in that phase from the next ``begin`` on.

Users rarely know every group their rollout touches (a logging all-reduce,
a reward model on the world group, an evaluation callback). Without this,
such a group is suspended at every ``begin`` and resumed by the guard a
moment later, every step: a transition's fixed cost per communicator, paid
twice for nothing. A learned keep enters the plan like any ``keep=``
name, so the members of the group still agree (a rank that did not learn it
votes to suspend, the agreement keeps it: never a hang, never a suspended
group under a collective).

Learned keeps are never forgotten by themselves: a group used once in a
phase is likely used again (the seams are the same every step), and a
wrong guess costs one guard resume while forgetting costs one every time it
returns. ``OffloadPolicy.forget_learned()`` drops them after a layout change.
"""

from __future__ import annotations

from dataclasses import dataclass

from .log import logger


@dataclass
class Learned:
    name: str
    guard_resumes: int
    phases_seen: int = 1  # phases in which the guard resumed it before it was learned


class LearnedKeeps:
    def __init__(self):
        self._by_phase: dict = {}  # phase -> {group key: Learned}

    def note(self, phase: str, resumed: dict) -> list:
        """Record the guard resumes of one phase (group key -> (name, count));
        returns the names learned just now."""
        learned = self._by_phase.setdefault(phase, {})
        new = []
        for key, (name, count) in sorted(resumed.items()):
            if key in learned:
                learned[key].guard_resumes += count
                learned[key].phases_seen += 1
            else:
                learned[key] = Learned(name, count)
                new.append(name)
        if new:
            logger.warning(
                "amem_callbacks: group(s) %s were used during phase %r, so the guard resumed "
                "them; they stay active in %r from the next begin on (learn_keep=False turns "
                "this off; policy.forget_learned() forgets it after a layout change)",
                new, phase, phase)
        return new

    def reasons(self, phase: str) -> dict:
        """Group key -> why it is kept, for the plan."""
        return {key: f"learned: the guard resumed it {item.guard_resumes} time(s) during "
                     f"phase {phase!r}" for key, item in self._by_phase.get(phase, {}).items()}

    def forget(self, phase=None) -> None:
        if phase is None:
            self._by_phase.clear()
        else:
            self._by_phase.pop(phase, None)

    def by_phase(self) -> dict:
        """phase -> {group name: guard resumes}, for reports and metrics."""
        return {phase: {item.name: item.guard_resumes for item in items.values()}
                for phase, items in self._by_phase.items()}
