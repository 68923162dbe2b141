"""Checks of one value, shared by every door a setting comes in by (the policy's
keyword arguments, the adapters' config keys and flags, the CLI): the limits where
a value really stops working, and the messages that say what to write instead."""

from __future__ import annotations

import argparse
import math
import threading
from typing import Callable

from .errors import OptionError

# Upper bounds, each where a value really stops working (CPython's and torch's own
# limits): past them a value passed construction and failed at the
# first begin, with the phase already open and the guard installed.
#: The longest wait a Python lock takes (threading.TIMEOUT_MAX, 9223372036 s on
#: Linux, about 292 years): Event.wait(1e12) raises "timestamp out of range for
#: platform time_t". Every wait of a transition is a lock wait. (The c10d store
#: takes up to timedelta's limit, 8.6e13 s, so the lock is the binding one.)
MAX_WAIT_S = threading.TIMEOUT_MAX
WAIT_LIMIT = "threading.TIMEOUT_MAX: the longest wait a Python lock takes, about 292 years"
#: Byte counts are 64-bit in NCCL's and CUDA's own accounts: nothing larger exists.
MAX_BYTES = 2**63 - 1
#: ncclSetGroupID and cudaSetDevice take a C int.
MAX_C_INT = 2**31 - 1
#: Threads per transition: past 4 NCCL's own barriers dominate (DEFAULT_WORKERS);
#: far more only wait on them.
MAX_WORKERS = 256


def check_phase(phase) -> None:
    if not isinstance(phase, str) or not phase:
        raise OptionError(f"a phase is a non-empty string such as 'rollout', got {phase!r}")


def number_range(minimum, maximum=None, integer=False, exclusive=False, why="") -> str:
    """How a message states an accepted range: "an integer >= 0 and <= 255 (why)"."""
    what = "an integer" if integer else "a number"
    text = f"{what} {'>' if exclusive else '>='} {minimum}"
    if maximum is not None:
        whole = isinstance(maximum, float) and maximum.is_integer()
        text += f" and <= {int(maximum) if whole else maximum}"
    return text + (f" ({why})" if why else "")


def shown(value, limit: int = 60) -> str:
    """``repr(value)``, cut short: a message quotes a 400-digit integer in full otherwise."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_number(name, value, minimum, integer=False, exclusive=False, maximum=None,
                 why="") -> None:
    """A number (an integer with ``integer``), finite, above ``minimum`` and at most
    ``maximum``; else OptionError stating the range and ``why`` it ends there."""
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    # inf and nan first: an inf passed every comparison with a minimum before
    ok = ok and not (isinstance(value, float) and not math.isfinite(value))
    ok = ok and (value > minimum if exclusive else value >= minimum)
    ok = ok and (maximum is None or value <= maximum)
    if not ok:
        raise OptionError(f"{name} must be "
                          f"{number_range(minimum, maximum, integer, exclusive, why)}, "
                          f"got {shown(value)}")


def check_wait(name, value, maximum=MAX_WAIT_S, why=WAIT_LIMIT) -> None:
    """A number of seconds a caller may wait: > 0, finite, a wait a lock takes."""
    check_number(name, value, minimum=0, exclusive=True, maximum=maximum, why=why)


def number_type(what: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number ``ok`` accepts, else a message
    saying ``what`` to write (the CLI's and Megatron's flags share these)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
        return value

    parse.__name__ = what.split(" ")[-1]
    return parse


def check_bool(name, value) -> None:
    if not isinstance(value, bool):
        raise OptionError(f"{name} must be True or False, got {value!r}")
