"""The package's vocabularies, one Enum each.

The str-valued ones compare equal to their strings, so reports, metrics and
JSON read the same words as before ("suspended", "keep", ...). A vocabulary a
user writes (a backend name, a guard mode) is checked here too, by one
function each that raises OptionError saying what to write instead.
"""

from __future__ import annotations

import enum

from .errors import OptionError


class _Word(str, enum.Enum):
    """A str Enum that prints as its word on every Python (3.12 changed format())."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def choices(cls) -> tuple:
        """Every word, in the order declared (for messages and argparse ``choices=``)."""
        return tuple(member.value for member in cls)

    @classmethod
    def lookup(cls, value):
        """The member ``value`` names, else None (a non-string is never one)."""
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        return None


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


class BackendName(_Word):
    """The backends a user names (``backend=``, ``--backend``, ``backend_options``
    keys); the classes behind them are in ``backends.BACKENDS``."""

    AUTO = "auto"  # nccl, then amem, else leave training untouched
    NCCL = "nccl"  # NCCL's own ncclCommSuspend (NCCL >= 2.29.7)
    AMEM = "amem"  # AMem's patched NCCL
    NOOP = "noop"  # a dry run: suspends nothing

    @classmethod
    def concrete(cls) -> tuple:
        """Every name of one real backend: all but "auto"."""
        return tuple(name for name in cls.choices() if name != cls.AUTO.value)


def guard_mode(value) -> GuardMode:
    """``value`` as a GuardMode, else OptionError naming the modes to write."""
    mode = GuardMode.lookup(value)
    if mode is None:
        raise OptionError(f"unknown guard mode {value!r}: write one of {GuardMode.choices()}")
    return mode


def backend_name(value) -> BackendName:
    """``value`` as a BackendName, else OptionError naming the backends to write."""
    name = BackendName.lookup(value)
    if name is None:
        raise OptionError(f"unknown backend {value!r}: write one of "
                          f"{', '.join(map(repr, BackendName.choices()))} "
                          "(or pass a Backend instance)")
    return name
