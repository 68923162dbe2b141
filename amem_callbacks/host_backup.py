"""Keeps NCCL's pinned host backup from one suspend to the next.

NCCL's suspend pins a new host block for every buffer it copies out, and its
resume unpins it: pinning and unpinning cost many times the copy, on every cycle,
and stall the process's GPU work while they run. The small C library in
``csrc/`` (built at install) hands NCCL's own CUDA runtime a
``cuMemHostAlloc``/``cuMemFreeHost`` that keep the blocks a resume frees and
give them back to the next suspend (same size, flags and context), by
answering the driver look-ups of that one library (csrc/lookup_hook.c says
how). Torch's pinned memory and every other library are untouched.

The hook has to be in place before NCCL's runtime first reaches the driver,
i.e. before the first communicator is created: the adapters install it where
they first run (the TRL callback's constructor, verl's ``init_model``, Megatron's
``add_args``), :class:`~amem_callbacks.OffloadPolicy` when it is constructed.
``AMEM_HOST_BACKUP=0`` (or ``OffloadOptions(reuse_host_backup=False)``) turns
it off. Kept bytes are bounded by the most one begin suspended on this rank,
released by ``policy.close()`` and at exit.

The first cycle still has to pin. For the NCCL releases read to use a backup only
as a copy's host side (``ZEROING_READ``), a new block is pinned by registering pages
the kernel got and zeroed first, not by ``cuMemHostAlloc``: measured on an H100
(results/one_h100/pin_paths), a third faster, and the process's GPU work runs on at
65 % of its rate instead of 6 %. ``AMEM_HOST_BACKUP_BLOCKS=allocated`` gives NCCL's own
``cuMemHostAlloc`` back.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.machinery
import os
import sys
import threading
from dataclasses import dataclass
from typing import Optional

#: ``AMEM_HOST_BACKUP=0`` in the environment: never install the hook.
ENV_SWITCH = "AMEM_HOST_BACKUP"
#: ``AMEM_HOST_BACKUP_BLOCKS``: how a new block is pinned (``BLOCK_KINDS``; the first
#: is the default, used only for the NCCL releases in ``ZEROING_READ``)
ENV_BLOCKS = "AMEM_HOST_BACKUP_BLOCKS"
BLOCK_KINDS = ("registered", "allocated")
SUSPEND, RESUME = 0, 1
_STAT_FIELDS = ("kept_bytes", "kept_blocks", "reused", "reused_bytes", "pinned_new",
                "pinned_new_bytes", "unpinned", "unpinned_bytes", "pin_ns", "unpin_ns",
                "lookups", "unknown", "alloc_wrapped", "free_wrapped", "limit_bytes",
                "reuse_on", "suspend_windows", "resume_windows", "zero_skipped",
                "zero_skipped_bytes", "registered_new", "registered_new_bytes",
                "register_failed", "registered_on")
#: NCCL releases whose suspend was read to zero each backup and copy over all of it
#: at once, on one thread (src/mem_manager.cc, ncclCudaHostCalloc then cudaMemcpy of the
#: same size): only there is the zeroing of a reused block left out.
ZEROING_READ = ((2, 30, 0), (2, 33, 0))


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in _STAT_FIELDS]  # amem_hb_stats_t


@dataclass(frozen=True)
class HookState:
    """Whether the hook is in NCCL's look-ups, and if not, why (with the fix)."""

    installed: bool
    why: str = ""
    nccl_path: str = ""


_lock = threading.Lock()
_state: Optional[HookState] = None
_lib = None


def library_path() -> Optional[str]:
    """The built hook next to this module, or None (not built: no C compiler at install)."""
    folder = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_host_backup" + suffix)
        if os.path.exists(path):
            return path
    return None


def _load():
    global _lib
    if _lib is None:
        path = library_path()
        if path is None:
            return None
        lib = ctypes.CDLL(path)  # never closed: NCCL's runtime keeps our function pointers
        lib.amem_hb_install.argtypes = (ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                        ctypes.c_size_t)
        lib.amem_hb_install.restype = ctypes.c_int
        for name in ("amem_hb_enter", "amem_hb_leave", "amem_hb_set_registered"):
            getattr(lib, name).argtypes = (ctypes.c_int,)
            getattr(lib, name).restype = None
        for name, args in (("amem_hb_set_limit", (ctypes.c_uint64,)),
                           ("amem_hb_set_reuse", (ctypes.c_int,)), ("amem_hb_release", ())):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_uint64
        lib.amem_hb_stats.argtypes = (ctypes.POINTER(_Stats),)
        lib.amem_hb_stats.restype = None
        _lib = lib
    return _lib


def switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "off", "no")


def install(nccl_path: Optional[str] = None) -> HookState:
    """Put the hook into the look-ups of the NCCL torch loaded (or ``nccl_path``).

    Idempotent; never loads NCCL or torch. A refusal changes nothing and says why.
    """
    global _state
    with _lock:
        if _state is not None and _state.installed:
            return _state
        _state = _install(nccl_path)
        if _state.installed:
            atexit.register(release)
        else:
            from .log import logger

            logger.debug("amem_callbacks: host-backup hook not installed: %s", _state.why)
        return _state


def _install(nccl_path: Optional[str]) -> HookState:
    if switched_off():
        return HookState(False, f"{ENV_SWITCH}=0 in the environment: NCCL re-pins its host "
                                "backup on every suspend")
    try:
        blocks = blocks_asked()
    except ValueError as bad:  # prepare() raised it at start-up; an import hook must not
        return HookState(False, str(bad))
    lib = _load()
    if lib is None:
        return HookState(False, "the host-backup hook was not built at install (no C compiler "
                                "then): install gcc and reinstall amem-callbacks")
    from .nccl_library import NcclLibrary  # ctypes only, no torch

    try:
        found = NcclLibrary.loaded() if nccl_path is None else \
            NcclLibrary(ctypes.CDLL(nccl_path, mode=os.RTLD_NOLOAD), nccl_path)
    except OSError:
        found = None
    if found is None and nccl_path is None:
        _retry_when_torch_loads()
        return HookState(False, "no NCCL is loaded in this process (a CPU-only torch, or "
                                "torch not imported yet: it is tried again when it is)")
    nccl_path = nccl_path or found.path
    low, high = ZEROING_READ
    skip_zeroing = found is not None and low <= found.version < high
    why = ctypes.create_string_buffer(512)
    code = lib.amem_hb_install(nccl_path.encode(), int(skip_zeroing), why, len(why))
    if code < 0:
        return HookState(False, why.value.decode(errors="replace"), nccl_path)
    # registration only where a backup was read to be a copy's host side alone: the
    # zeroing it leaves out, and no mapped-pointer use NCCL might make of it elsewhere
    lib.amem_hb_set_registered(int(skip_zeroing and blocks == "registered"))
    return HookState(True, "", nccl_path)


def blocks_asked() -> str:
    """``AMEM_HOST_BACKUP_BLOCKS``, checked: one of ``BLOCK_KINDS`` (unset: the first)."""
    value = os.environ.get(ENV_BLOCKS, "").strip().lower() or BLOCK_KINDS[0]
    if value not in BLOCK_KINDS:
        raise ValueError(f"{ENV_BLOCKS}={os.environ[ENV_BLOCKS]!r} is not a kind of host "
                         f"block: write {' or '.join(BLOCK_KINDS)} (or leave it unset)")
    return value


_waiting_for_torch = False


def _retry_when_torch_loads() -> None:
    """Torch loads NCCL with its CUDA library: install then, still before any communicator."""
    global _waiting_for_torch
    if _waiting_for_torch or "torch" in sys.modules:
        return
    _waiting_for_torch = True
    from .patching import when_imported

    when_imported("torch", lambda _module: install())


def state() -> Optional[HookState]:
    """The last install's outcome (None before any)."""
    return _state


def installed() -> bool:
    return _state is not None and _state.installed


@contextlib.contextmanager
def window(kind: int):
    """Around one NCCL suspend (``SUSPEND``) or resume (``RESUME``): while it is
    open, allocations may take kept blocks, frees are kept. Nothing when not installed."""
    if not installed():
        yield
        return
    _lib.amem_hb_enter(kind)
    try:
        yield
    finally:
        _lib.amem_hb_leave(kind)


def bound(nbytes: int) -> None:
    """Keep at most ``nbytes`` between a resume and the next suspend (the policy gives
    the most one begin suspends on this rank); lowering it unpins what is over."""
    if installed():
        _lib.amem_hb_set_limit(max(0, int(nbytes)))


def set_reuse(on: bool) -> None:
    """Off: NCCL's allocations go to the driver unchanged, kept blocks are unpinned."""
    if installed():
        _lib.amem_hb_set_reuse(1 if on else 0)


def release() -> int:
    """Unpin every kept block; the bytes unpinned."""
    return int(_lib.amem_hb_release()) if installed() else 0


def stats() -> dict:
    """The hook's counts (empty when not installed)."""
    if not installed():
        return {}
    raw = _Stats()
    _lib.amem_hb_stats(ctypes.byref(raw))
    return {name: int(getattr(raw, name)) for name in _STAT_FIELDS}


def active() -> bool:
    """NCCL's runtime took our allocation functions and reuse is on: the backup is kept."""
    figures = stats()
    return bool(figures.get("alloc_wrapped") and figures.get("free_wrapped")
                and figures.get("reuse_on"))


def why_inactive() -> str:
    """Why the backup is re-pinned on every suspend, with the fix ("" when active)."""
    if _state is None:
        return "the host-backup hook was never installed (no policy or adapter made yet)"
    if not _state.installed:
        return _state.why
    if not stats().get("reuse_on", 1):
        return "reuse_host_backup=False: NCCL re-pins its host backup on every suspend"
    if active():
        return ""
    # Which of the two cannot be told from here: nothing marks a runtime that started.
    return ("NCCL's CUDA runtime has not taken the hook's host allocation: it reached the "
            "driver before the hook was installed (import the adapter, or make the "
            "OffloadPolicy, before the first NCCL communicator is created), or it finds the "
            "driver in a way the hook does not recognise")


def metrics(prefix: str = "amem/") -> dict:
    """``amem/host_backup/...``: kept bytes, blocks reused and newly pinned, seconds
    spent pinning and unpinning; ``active`` 0 with no other key when it is not working."""
    figures = stats()
    out = {f"{prefix}host_backup/active": int(bool(figures) and active())}
    if figures:
        p = prefix + "host_backup/"
        for name in ("kept_bytes", "reused", "reused_bytes", "pinned_new", "pinned_new_bytes",
                     "unpinned", "limit_bytes", "zero_skipped", "registered_new"):
            out[p + name] = figures[name]
        out[p + "pin_seconds"] = figures["pin_ns"] / 1e9
        out[p + "unpin_seconds"] = figures["unpin_ns"] / 1e9
    return out


# --- what a policy does with it ------------------------------------------------
def _nccl_path_for(backend) -> Optional[str]:
    """The library the hook goes into for ``backend`` (a name or a Backend): "" for
    the NCCL torch loaded, None where no NCCL suspend runs (amem's patched NCCL
    pauses its own way, noop suspends nothing)."""
    name = backend if isinstance(backend, str) else getattr(backend, "name", "")
    if name not in ("auto", "nccl") or getattr(backend, "dry_run", False):
        return None
    library = getattr(backend, "_library", None)
    return getattr(library, "path", "") or ""


def applies_to(backend) -> bool:
    """Whether ``backend`` (a name or a Backend) suspends through an NCCL the hook serves."""
    return _nccl_path_for(backend) is not None


def prepare(options, backend=None) -> None:
    """At a policy's construction (``backend`` None: the option's name), at its set-up
    (the backend chosen) and where an adapter knows its options before the first
    communicator: install the hook, or turn reuse off as asked. A bad
    ``AMEM_HOST_BACKUP_BLOCKS`` raises here, before anything is applied."""
    blocks_asked()
    if not options.reuse_host_backup:
        set_reuse(False)
        return
    path = _nccl_path_for(options.backend if backend is None else backend)
    if path is not None and not installed():
        install(path or None)


_told = False


def tell_once(options, backend) -> None:
    """One log line per process, at the first set-up that suspends through NCCL:
    whether the backup is kept, and if not why and how to fix it."""
    global _told
    if _told or not options.reuse_host_backup or not applies_to(backend):
        return
    _told = True
    from .log import logger

    why = why_inactive()
    if why:
        logger.info("amem_callbacks: NCCL re-pins its host backup on every suspend: %s", why)
    else:
        logger.info("amem_callbacks: keeping NCCL's pinned host backup between suspends "
                    "(%s; AMEM_HOST_BACKUP=0 or reuse_host_backup=False turns it off)",
                    _state.nccl_path)
