"""The package's vocabularies, one Enum each.

The str-valued ones compare equal to their strings, so reports, metrics and
JSON read the same words as before ("suspended", "keep", ...).
"""

from __future__ import annotations

import enum


class _Word(str, enum.Enum):
    """A str Enum that prints as its word on every Python (3.12 changed format())."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Verdict(_Word):
    """What a plan proposes for a group, what a rank votes and what members agree on."""

    SUSPEND = "suspend"
    KEEP = "keep"


class Outcome(_Word):
    """What one transition did to one group, as reported."""

    SUSPENDED = "suspended"
    RESUMED = "resumed"
    KEPT = "kept"
    FAILED = "failed"
    WOULD_SUSPEND = "would suspend"  # dry run (noop backend)
    WOULD_RESUME = "would resume"


class Status(_Word):
    """Where a group the policy touched stands now (written by the worker only;
    read through ``OffloadPolicy.groups()``)."""

    ACTIVE = "active"
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    BROKEN = "broken"  # a suspend or resume failed beyond repair: calls on it raise


class Kind(_Word):
    """Which side of a phase a transition is."""

    BEGIN = "begin"
    END = "end"


class GuardMode(_Word):
    """What a call on a suspended group does."""

    RESUME = "resume"  # resume the group first (collective over its members)
    STRICT = "strict"  # raise SuspendedGroupError
    OFF = "off"  # nothing intercepts calls; end() waits for its resumes itself
