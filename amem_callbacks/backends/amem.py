"""The AMem NCCL plugin: a patched NCCL with process-wide ``ncclPause/ncclResume``.

AMem replaces ``libnccl.so.2`` itself, so it works only when its library *is*
the NCCL torch loaded. One pause covers every communicator of the process on
the current device; the policy therefore cannot keep any group active with it.
Its library is never loaded here: its load-time constructor deletes files
and starts shells, and a second NCCL copy would not know torch's
communicators anyway.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from ..errors import BackendUnavailable
from ..nccl_library import NcclLibrary, version_string
from .base import Backend
from .nccl import torch_comm_handle

AMEM_ENV = ("NCCL_CUMEM_ENABLE", "AMEM_ENABLE")
_VERSION_IN_BINARY = re.compile(rb"NCCL version (\d+)\.(\d+)\.(\d+)")


def nccl_version_in_file(path: str) -> Optional[tuple]:
    """The NCCL version string baked into a library file, read without loading it."""
    try:
        with open(path, "rb") as handle:
            match = _VERSION_IN_BINARY.search(handle.read())
    except OSError:
        return None
    return tuple(int(part) for part in match.groups()) if match else None


def torch_built_nccl_version() -> Optional[tuple]:
    try:
        import torch  # optional: torch may be missing (None then)

        version = torch.cuda.nccl.version()
    except Exception:
        return None
    return tuple(version) if isinstance(version, tuple) else None


class AmemBackend(Backend):
    """Pauses every NCCL communicator of the process with AMem's ``ncclPause``.

    Args:
        library_path: where the AMem-patched ``libnccl.so.2`` lives; it must be
            the NCCL torch loaded (put its folder first in LD_LIBRARY_PATH).
        group_id: ``ncclSetGroupID`` value; AMem refuses it after NCCL's first
            allocation, so set it before any communicator exists.
    """

    name = "amem"
    process_wide = True

    @staticmethod
    def check_options(library_path=None, group_id=None, library=None, handle_of=None) -> None:
        """Raise ValueError naming the fix for a bad option value."""
        if library_path is not None and (not isinstance(library_path, str) or not library_path):
            raise ValueError(f"library_path must be the path of AMem's libnccl.so.2, "
                             f"got {library_path!r}")
        if group_id is not None and (not isinstance(group_id, int) or isinstance(group_id, bool)
                                     or group_id < 0):
            raise ValueError(f"group_id must be an integer >= 0, got {group_id!r}")

    def __init__(self, library_path: Optional[str] = None, group_id: Optional[int] = None,
                 library: Optional[NcclLibrary] = None, handle_of=None):
        self.check_options(library_path, group_id, library, handle_of)
        self.library_path = library_path
        self.group_id = group_id
        self._library = library
        self._handle_of = handle_of or torch_comm_handle

    def check(self) -> str:
        lib = self._library or NcclLibrary.loaded()
        if self.library_path and (lib is None or not _same_file(lib.path, self.library_path)):
            raise BackendUnavailable(self._not_loaded_reason(lib), self._load_fix())
        if lib is None:
            raise BackendUnavailable("no NCCL library is loaded in this process.", self._load_fix())
        if not lib.is_amem:
            raise BackendUnavailable(
                f"the loaded NCCL ({lib.path}, {lib.version_str}) is not AMem's: it has no ncclPause.",
                self._load_fix())
        missing = [name for name in AMEM_ENV if os.environ.get(name) != "1"]
        if missing:
            raise BackendUnavailable(
                "AMem needs " + " and ".join(f"{n}=1" for n in missing)
                + " set before its library loads.",
                "export " + " ".join(f"{n}=1" for n in AMEM_ENV) + " before starting Python")
        if self.group_id is not None:
            lib.amem_set_group_id(self.group_id)
        self._library = lib
        return f"AMem NCCL {lib.version_str} from {lib.path} (process-wide pause)"

    def _not_loaded_reason(self, lib: Optional[NcclLibrary]) -> str:
        reason = (f"AMem's library {self.library_path} is not the NCCL torch loaded "
                  f"({lib.path if lib else 'none loaded'}).")
        amem_version = nccl_version_in_file(self.library_path)
        built = torch_built_nccl_version()
        if amem_version and built and amem_version[:2] < built[:2]:
            reason += (f" This torch was built against NCCL {version_string(built)}; AMem's "
                       f"patched NCCL {version_string(amem_version)} lacks symbols it needs, so "
                       "torch cannot run on it (measured: torch 2.11 fails to import or aborts).")
        return reason

    def _load_fix(self) -> str:
        where = os.path.dirname(self.library_path) if self.library_path else "<amem lib dir>"
        return (f"start Python with LD_LIBRARY_PATH={where}:$LD_LIBRARY_PATH and a torch built "
                "against the same NCCL minor version (never put AMem in LD_PRELOAD: its "
                "constructor starts shells that inherit it); or use backend='nccl' with "
                "NCCL >= 2.29.7")

    def communicator(self, group) -> tuple:
        return self._handle_of(group)

    def suspend(self, handle) -> None:
        self._library.amem_pause()

    def resume(self, handle) -> None:
        self._library.amem_resume()


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
