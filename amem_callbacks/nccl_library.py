"""The NCCL library torch already loaded, bound with plain ctypes.

Why ctypes and not NVIDIA's nccl4py: suspend/resume only work on the
communicators of the NCCL copy that created them, i.e. the ``libnccl.so.2``
that torch loaded. We must bind *that* copy (``RTLD_NOLOAD``), never load a
second one. nccl4py brings its own NCCL and cuda-bindings dependency and would
add hundreds of MB to an install that needs eight functions. A declarative
table of those functions is smaller, testable against a stand-in library, and
lets a missing optional symbol become a clear "needs NCCL >= X" message.
And a ``ctypes.CDLL`` call releases the GIL for its duration (``PyDLL`` would
not): a suspend waiting in NCCL's barriers for seconds never stops the
process's other Python threads, unlike torch's own ``Backend.suspend()``.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Optional

from .errors import NcclError

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p

NCCL_SUSPEND_MEM = 0x01
# ncclCommMemStat_t
STAT_SUSPENDABLE = 0
STAT_SUSPENDED = 1
STAT_PERSIST = 2
STAT_TOTAL = 3

NCCL_SUCCESS = 0

#: First NCCL release with ncclCommSuspend/Resume/MemStats.
SUSPEND_MIN_VERSION = (2, 29, 7)


@dataclass(frozen=True)
class Function:
    name: str
    restype: object
    argtypes: tuple
    optional: bool = False


# One row per symbol; the C prototype is in the comment.
FUNCTIONS = (
    # ncclResult_t ncclGetVersion(int* version)
    Function("ncclGetVersion", ncclResult_t, (ctypes.POINTER(ctypes.c_int),)),
    # const char* ncclGetErrorString(ncclResult_t result)
    Function("ncclGetErrorString", ctypes.c_char_p, (ncclResult_t,)),
    # const char* ncclGetLastError(ncclComm_t comm)
    Function("ncclGetLastError", ctypes.c_char_p, (ncclComm_t,), optional=True),
    # ncclResult_t ncclCommSuspend(ncclComm_t comm, int flags)      [>= 2.29.7]
    Function("ncclCommSuspend", ncclResult_t, (ncclComm_t, ctypes.c_int), optional=True),
    # ncclResult_t ncclCommResume(ncclComm_t comm)                  [>= 2.29.7]
    Function("ncclCommResume", ncclResult_t, (ncclComm_t,), optional=True),
    # ncclResult_t ncclCommMemStats(ncclComm_t, ncclCommMemStat_t, uint64_t*)
    Function("ncclCommMemStats", ncclResult_t,
             (ncclComm_t, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)), optional=True),
    # AMem plugin (patched NCCL): ncclResult_t ncclPause(ncclComm_t* comm)
    Function("ncclPause", ncclResult_t, (ctypes.POINTER(ncclComm_t),), optional=True),
    # ncclResult_t ncclResume(ncclComm_t* comm)
    Function("ncclResume", ncclResult_t, (ctypes.POINTER(ncclComm_t),), optional=True),
    # ncclResult_t ncclSetGroupID(int id)
    Function("ncclSetGroupID", ncclResult_t, (ctypes.c_int,), optional=True),
    # ncclResult_t ncclGetGroupID(int* id)
    Function("ncclGetGroupID", ncclResult_t, (ctypes.POINTER(ctypes.c_int),), optional=True),
)

SUSPEND_SYMBOLS = ("ncclCommSuspend", "ncclCommResume", "ncclCommMemStats")
AMEM_SYMBOLS = ("ncclPause", "ncclResume", "ncclSetGroupID")


def version_tuple(code: int) -> tuple:
    """NCCL encodes 2.29.7 as 22907 (>= 2.9) and 2.8.4 as 2804."""
    if code >= 10000:
        return (code // 10000, (code % 10000) // 100, code % 100)
    return (code // 1000, (code % 1000) // 100, code % 100)


def version_string(version: tuple) -> str:
    return ".".join(str(part) for part in version)


def loaded_nccl_paths() -> list:
    """Paths of every libnccl mapped into this process (Linux /proc)."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and "libnccl" in os.path.basename(parts[5].strip()):
                    path = parts[5].strip()
                    if path not in paths:
                        paths.append(path)
    except OSError:
        pass
    return paths


class NcclLibrary:
    """Bound functions of one NCCL shared library.

    Use :meth:`loaded` for the library torch is running on; :meth:`open` takes
    an explicit path (tests use it with a stand-in library).
    """

    def __init__(self, handle: ctypes.CDLL, path: str):
        self._handle = handle
        self.path = path
        self._fns = {}
        for fn in FUNCTIONS:
            try:
                cfn = getattr(handle, fn.name)
            except AttributeError:
                if fn.optional:
                    continue
                raise OSError(f"{path} is not an NCCL library: it has no {fn.name}")
            cfn.restype = fn.restype
            cfn.argtypes = fn.argtypes
            self._fns[fn.name] = cfn
        raw = ctypes.c_int()
        self._check(self._fns["ncclGetVersion"](ctypes.byref(raw)), "ncclGetVersion")
        self.version = version_tuple(raw.value)

    @classmethod
    def loaded(cls) -> Optional["NcclLibrary"]:
        """The NCCL torch's calls resolve to, or None. Never loads a new copy.

        Two copies can be mapped (e.g. torch's wheel copy plus an LD_PRELOAD
        one). Torch's references bind to the first definition in the global
        scope, so that is where ``ncclGetVersion`` is looked up first.
        """
        address = _global_symbol_address("ncclGetVersion")
        names = ([_path_of_address(address)] if address else []) + ["libnccl.so.2"] + \
            loaded_nccl_paths()
        for name in names:
            if not name:
                continue
            try:
                handle = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
            except OSError:
                continue
            return cls(handle, _path_of_address(_address(handle.ncclGetVersion)) or name)
        return None

    @classmethod
    def open(cls, path: str) -> "NcclLibrary":
        return cls(ctypes.CDLL(path), path)

    @property
    def version_str(self) -> str:
        return version_string(self.version)

    def has(self, symbol: str) -> bool:
        return symbol in self._fns

    @property
    def has_suspend(self) -> bool:
        return all(self.has(s) for s in SUSPEND_SYMBOLS)

    @property
    def is_amem(self) -> bool:
        return all(self.has(s) for s in AMEM_SYMBOLS)

    def _check(self, result: int, what: str, comm: Optional[int] = None) -> None:
        if result == NCCL_SUCCESS:
            return
        message = self._fns["ncclGetErrorString"](result)
        text = message.decode(errors="replace") if message else f"error {result}"
        if comm and "ncclGetLastError" in self._fns:
            last = self._fns["ncclGetLastError"](comm)
            if last:
                text += f" ({last.decode(errors='replace')})"
        raise NcclError(what, result, text)

    # --- native suspend (NCCL >= 2.29.7) ---------------------------------
    def comm_suspend(self, comm: int) -> None:
        self._check(self._fns["ncclCommSuspend"](comm, NCCL_SUSPEND_MEM), "ncclCommSuspend", comm)

    def comm_resume(self, comm: int) -> None:
        self._check(self._fns["ncclCommResume"](comm), "ncclCommResume", comm)

    def comm_mem_stat(self, comm: int, stat: int) -> int:
        value = ctypes.c_uint64()
        self._check(self._fns["ncclCommMemStats"](comm, stat, ctypes.byref(value)),
                    "ncclCommMemStats", comm)
        return value.value

    # --- AMem plugin (process-wide) --------------------------------------
    def amem_pause(self) -> None:
        unused = ncclComm_t()
        self._check(self._fns["ncclPause"](ctypes.byref(unused)), "ncclPause")

    def amem_resume(self) -> None:
        unused = ncclComm_t()
        self._check(self._fns["ncclResume"](ctypes.byref(unused)), "ncclResume")

    def amem_set_group_id(self, group_id: int) -> None:
        self._check(self._fns["ncclSetGroupID"](group_id), "ncclSetGroupID")


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _global_symbol_address(name: str) -> int:
    try:
        return _address(getattr(ctypes.CDLL(None), name))
    except AttributeError:
        return 0


def _path_of_address(address: int) -> Optional[str]:
    """The file that defines the code at ``address`` (glibc dladdr)."""
    if not address:
        return None
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:
        return None
    dladdr.argtypes = (ctypes.c_void_p, ctypes.POINTER(_DlInfo))
    info = _DlInfo()
    if dladdr(address, ctypes.byref(info)) and info.dli_fname:
        return os.path.realpath(info.dli_fname.decode())
    return None
