"""Deliberate bugs for the mutation check (tests/test_mutations.py), applied
from test code inside a rank process; the package itself has no hooks for them.

``python -m tests.scenarios`` applies the mutations named in the environment
variable :data:`ENV` (comma separated) before it runs the scenario:

``guard-off``
    The guard lets every call through: the transitions engine's
    ``before_use`` (what ``amem_callbacks.guard`` asks of a group's owner
    before a call) does nothing, so a call on a suspended group is neither
    resumed first nor refused.
``skip-resume:NAME``
    A resume is skipped: ``Transitions._resume`` does nothing for the group
    named NAME (``end()`` and the guard's resumes both run through it), so that
    group stays suspended while the policy believes it resumed.

Both are written against the engine's methods, not the guard's internals, so
they keep working while the guard is rewritten.
"""

from __future__ import annotations

import os
import sys

ENV = "AMEM_TEST_MUTATE"
KNOWN = ("guard-off", "skip-resume")


def apply(spec: str) -> list:
    """Apply every mutation in ``spec``; return their names."""
    from amem_callbacks import transitions

    applied = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, arg = item.partition(":")
        if kind == "guard-off":
            def before_use(self, group, kind, call):
                return None

            transitions.Transitions.before_use = before_use
        elif kind == "skip-resume":
            if not arg:
                raise ValueError("skip-resume needs a group name: skip-resume:NAME")
            original = transitions.Transitions._resume

            def _resume(self, state, rep, _original=original, _name=arg):
                if state.info.name == _name:
                    return None  # mutation: this group's resume never happens
                return _original(self, state, rep)

            transitions.Transitions._resume = _resume
        else:
            raise ValueError(f"unknown mutation {item!r}; known: {', '.join(KNOWN)}")
        applied.append(item)
    sys.stderr.write(f"[rank {os.environ.get('RANK', '?')}] MUTATION applied: "
                     f"{', '.join(applied)}\n")
    return applied
