"""Run a user's training script the way ``python SCRIPT.py`` or ``python -m
MODULE`` would, after an adapter took its own flags out of the command line
and installed its hooks (``python -m amem_callbacks.adapters.megatron``)."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import runpy
import sys
from typing import Callable, Optional, Sequence

from ..availability import is_importable
from ..log import logger


def run_with_flags(parser: argparse.ArgumentParser, argv: Sequence[str],
                   install: Callable[[argparse.Namespace], object],
                   prefix: Optional[str] = None) -> None:
    """Take ``parser``'s flags out of ``argv`` (they may stand anywhere), check
    the target exists, ``install(flags)``, then run ``SCRIPT.py [ARGS]`` or
    ``-m MODULE [ARGS]`` with the rest. Bad input exits 2 with one line; so does
    a flag starting with ``prefix`` (the adapter's own, e.g. ``--rl-amem-``)
    that ``parser`` does not define, naming the closest one."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        sys.exit(0 if argv else 2)
    ours, rest = parser.parse_known_args(argv)  # a bad value exits 2 naming the choices
    if prefix:
        reject_unknown(parser, rest, prefix)
    as_module = rest[:1] == ["-m"] and len(rest) > 1
    if not (as_module or rest and not rest[0].startswith("-")):
        parser.error("give the script to run first: SCRIPT.py [ARGS...] or -m MODULE [ARGS...]")
    if as_module and not is_importable(rest[1]):
        parser.error(f"no module named {rest[1]!r}")
    if not as_module and not os.path.isfile(rest[0]):
        parser.error(f"no such script: {rest[0]}")
    log_to_stderr()
    install(ours)
    if as_module:
        sys.argv = rest[1:]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))  # as `python SCRIPT.py` does
        runpy.run_path(rest[0], run_name="__main__")


def reject_unknown(parser: argparse.ArgumentParser, rest: Sequence[str], prefix: str) -> None:
    """A misspelt flag of ours would reach the script, which may well ignore it:
    the offload would stay off and nothing would say so. Fail on it instead,
    with the closest real flag, as argparse suggests a choice."""
    known = sorted(o for a in parser._actions for o in a.option_strings if o.startswith(prefix))
    for token in rest:
        if token == "--":
            return  # what follows is the script's alone
        flag = token.split("=", 1)[0]
        if flag.startswith(prefix) and flag not in known:
            close = closest(flag, known, prefix)
            hint = (f"did you mean {' or '.join(close)}?" if close else
                    f"the flags are {', '.join(known)}")
            parser.error(f"unknown flag {flag}: {hint}")


def closest(flag: str, known: Sequence[str], prefix: str) -> list:
    """The flags ``flag`` is a cut-short form of, else the nearest by difflib.
    Compared without the shared prefix, which would make every flag look alike
    (``--rl-amem-offload`` was nearer ``--rl-amem-backend`` than the flag it cuts)."""
    tails = {name[len(prefix):]: name for name in known}
    tail = flag[len(prefix):]
    cut_short = [name for t, name in tails.items() if tail and t.startswith(tail)]
    if cut_short:
        return cut_short
    return [tails[t] for t in difflib.get_close_matches(tail, list(tails), n=1, cutoff=0.6)]


def log_to_stderr() -> None:
    """The package's log lines on stderr, one per line, prefixed with the rank."""
    log = logger
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {os.environ.get('RANK', '0')}] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the script may configure the root logger too: one line each
