"""``python -m amem_callbacks.adapters.megatron SCRIPT.py|-m MODULE [ARGS...]``: the launcher
(docs/megatron.md); it takes the ``--rl-amem-*`` flags out, installs the hooks, runs the script."""

import sys

from amem_callbacks.tools.run_script import run_with_flags

from . import install
from .args import PREFIX, launcher_parser


def main(argv=None) -> None:
    run_with_flags(launcher_parser(), sys.argv[1:] if argv is None else argv, install,
                   prefix=PREFIX)


if __name__ == "__main__":
    main()
