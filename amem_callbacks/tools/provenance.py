"""What a record was made with: the package's commit and the machine (card, driver,
torch, the NCCL loaded), so that a result file read on its own says where it came from.
The bench writes them into its JSON; the GPU scripts' records use the same two."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Optional

#: the tree this package was installed from (an editable install: the checkout)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def commit(root: Optional[str] = None) -> Optional[str]:
    """``AMEM_COMMIT`` where the caller says it (a copy of the tree can carry the git
    metadata of an earlier commit than its files: measured on the GPU machine), else
    ``git rev-parse HEAD`` where ``root`` is itself the top of a checkout (an export
    inside another checkout must not read that one's), else a ``COMMIT`` file written
    at export; None where nothing says."""
    if os.environ.get("AMEM_COMMIT"):
        return os.environ["AMEM_COMMIT"]
    root = root or PACKAGE_ROOT
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        lines = out.stdout.split()
        if out.returncode == 0 and len(lines) == 2 and \
                os.path.realpath(lines[0]) == os.path.realpath(root):
            return lines[1]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open(os.path.join(root, "COMMIT")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def machine(nccl_library=None, gpu: bool = True) -> dict:
    """Card, driver, torch, Python and the NCCL loaded (``nccl_library``: the one in use,
    default the one torch loaded). ``gpu`` False: no card asked for (a CPU run)."""
    import torch  # light import: a record is only written where torch runs

    if nccl_library is None and gpu:
        from ..nccl_library import NcclLibrary

        nccl_library = NcclLibrary.loaded()
    out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "python": platform.python_version(),
           "nccl_loaded": (f"{nccl_library.version_str} ({nccl_library.path})"
                           if nccl_library else None)}
    if not gpu or not torch.cuda.is_available():
        return {**out, "card": None, "driver": None}
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=20).stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = None
    return {**out, "card": torch.cuda.get_device_name(), "driver": driver,
            "gpus_visible": torch.cuda.device_count()}
