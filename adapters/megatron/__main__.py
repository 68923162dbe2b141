"""``python -m amem_callbacks.adapters.megatron SCRIPT.py [ARGS...]``.

Takes the ``--rl-amem-*`` flags out of the command line (so the script's own
parser never sees them), installs the rollout hooks with them, then runs the
script as ``python SCRIPT.py ARGS...`` would (``-m MODULE`` as ``python -m``).
Under torchrun: ``torchrun ... -m amem_callbacks.adapters.megatron train_rl.py ...``.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys


def _log_to_stderr() -> None:
    log = logging.getLogger("amem_callbacks")
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {os.environ.get('RANK', '0')}] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # Megatron may configure the root logger too: one line each


def _module_exists(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package raises
        return False


def main(argv=None) -> None:
    from . import install
    from .args import launcher_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = launcher_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        sys.exit(0 if argv else 2)
    ours, rest = parser.parse_known_args(argv)  # a bad value exits 2 naming the choices
    module_target = rest[:1] == ["-m"] and len(rest) > 1
    if not (module_target or rest and not rest[0].startswith("-")):
        parser.error("give the script to run first: SCRIPT.py [ARGS...] or -m MODULE [ARGS...]")
    if module_target and not _module_exists(rest[1]):
        parser.error(f"no module named {rest[1]!r}")
    if not module_target and not os.path.isfile(rest[0]):
        parser.error(f"no such script: {rest[0]}")
    _log_to_stderr()
    install(ours)
    if module_target:
        module, rest = rest[1], rest[2:]
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = rest[0], rest[1:]
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT.py` does
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
