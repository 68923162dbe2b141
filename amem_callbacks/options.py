"""Checks of user input shared by the policy and the adapters: each error says
what to write instead."""

from __future__ import annotations

from typing import Mapping


def check_phase(phase) -> None:
    if not isinstance(phase, str) or not phase:
        raise ValueError(f"a phase is a non-empty string such as 'rollout', got {phase!r}")


def check_number(name, value, minimum, integer=False, exclusive=False) -> None:
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    ok = ok and (value > minimum if exclusive else value >= minimum)
    if not ok:
        bound = f"> {minimum}" if exclusive else f">= {minimum}"
        what = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {what} {bound}, got {value!r}")


def normalise_keep(keep) -> dict:
    """``keep`` as {phase or "*": frozenset(names)}, validated against known names."""
    from .groups import existing_group_names, registered_roles

    if isinstance(keep, str):
        raise ValueError(f"keep must be a list of group names, e.g. [{keep!r}], not a string")
    by_phase = dict(keep) if isinstance(keep, Mapping) else {"*": keep}
    valid = registered_roles() | existing_group_names()
    out = {}
    for phase, names in by_phase.items():
        if isinstance(names, str):
            raise ValueError(f"keep[{phase!r}] must be a list of group names, e.g. [{names!r}]")
        names = frozenset(names)
        unknown = sorted(n for n in names if not isinstance(n, str) or n not in valid)
        if unknown:
            raise ValueError(
                f"unknown group name(s) {unknown} in keep: use group roles {sorted(valid)}, "
                "or name your group first with amem_callbacks.name_group(group, 'name') or "
                "new_group(..., group_desc='name')")
        out[phase] = names
    return out
