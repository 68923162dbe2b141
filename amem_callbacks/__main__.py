"""``python -m amem_callbacks`` runs the ``amem-callbacks`` command (no torch until a
subcommand needs it)."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
