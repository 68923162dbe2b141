"""``python -m amem_callbacks.adapters.megatron SCRIPT.py|-m MODULE [ARGS...]``:
takes the ``--rl-amem-*`` flags out of the command line (the script's parser
never sees them), installs the rollout hooks with them, and runs the script.
Under torchrun: ``torchrun ... -m amem_callbacks.adapters.megatron train_rl.py ...``.
"""

import sys

from amem_callbacks.tools.run_script import run_with_flags

from . import install
from .args import launcher_parser


def main(argv=None) -> None:
    run_with_flags(launcher_parser(), sys.argv[1:] if argv is None else argv, install)


if __name__ == "__main__":
    main()
