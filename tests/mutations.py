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
    A resume is skipped: ``Transitions.resume_one`` does nothing for the group
    named NAME (``end()`` and the guard's resumes both run through it), so that
    group stays suspended while the policy believes it resumed.
``rename-view-field:OLD=NEW``
    A field of the public ``GroupView`` (what ``OffloadPolicy.groups()`` and
    ``view()`` return) is renamed from OLD to NEW, in the class and where the
    engine builds it: what a rename in the package leaves for a caller that
    still reads OLD. Applied by tests/gpu/common.py in the GPU scripts' CPU mode;
    tests/test_mutations.py shows the CPU run of tests/gpu/core_gpu.py then fails
    on the read of OLD, as it would have failed on every GPU host.

The first two are written against the engine's methods, not the guard's
internals, so they keep working while the guard is rewritten.
"""

from __future__ import annotations

import dataclasses
import os
import sys

ENV = "AMEM_TEST_MUTATE"
KNOWN = ("guard-off", "skip-resume", "rename-view-field")


def apply(spec: str) -> list:
    """Apply every mutation in ``spec``; return their names."""
    from amem_callbacks import guard_owner, transitions

    applied = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, arg = item.partition(":")
        if kind == "guard-off":
            def before_use(self, group, kind, call):
                return None

            guard_owner.GuardOwner.before_use = before_use
        elif kind == "skip-resume":
            if not arg:
                raise ValueError("skip-resume needs a group name: skip-resume:NAME")
            original = transitions.Transitions.resume_one

            def resume_one(self, state, _original=original, _name=arg):
                if state.info.name == _name:  # mutation: this group's resume never happens
                    return transitions.GroupOutcome(transitions.Outcome.RESUMED)
                return _original(self, state)

            transitions.Transitions.resume_one = resume_one
        elif kind == "rename-view-field":
            old, _, new = arg.partition("=")
            if not (old and new):
                raise ValueError("rename-view-field needs OLD=NEW: rename-view-field:a=b")
            _rename_view_field(old, new)
        else:
            raise ValueError(f"unknown mutation {item!r}; known: {', '.join(KNOWN)}")
        applied.append(item)
    sys.stderr.write(f"[rank {os.environ.get('RANK', '?')}] MUTATION applied: "
                     f"{', '.join(applied)}\n")
    return applied


def _rename_view_field(old: str, new: str) -> None:
    """GroupView with ``old`` called ``new``, everywhere the package names the class."""
    from amem_callbacks import group_book, report

    original = report.GroupView
    fields = [(new if f.name == old else f.name, f.type, dataclasses.field(default=f.default)
               if f.default is not dataclasses.MISSING else dataclasses.field())
              for f in dataclasses.fields(original)]
    if new not in {name for name, _, _ in fields}:
        raise ValueError(f"GroupView has no field {old!r}")

    def as_dict(self):  # the original's reads ``old``: this one reads what is there
        return {name: str(value) if name == "status" else value
                for name, value in dataclasses.asdict(self).items()}

    renamed = dataclasses.make_dataclass("GroupView", fields, frozen=True,
                                         namespace={"as_dict": as_dict,
                                                    "__doc__": original.__doc__})

    def build(**values):  # the engine's constructor call, with the new name
        return renamed(**{new if name == old else name: value for name, value in values.items()})

    report.GroupView = renamed
    group_book.GroupView = build
