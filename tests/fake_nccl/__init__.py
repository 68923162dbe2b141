"""Builds the stand-in NCCL library and drives its test controls."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

SOURCE = os.path.join(os.path.dirname(__file__), "fake_nccl.c")
DRIVER = os.path.join(os.path.dirname(__file__), "fake_cuda.c")
PROBE = os.path.join(os.path.dirname(__file__), "fake_probe.c")
VARIANTS = {
    "suspend": [],
    "old": ["-DNO_SUSPEND", "-DFAKE_VERSION=22809", '-DFAKE_VERSION_STR="2.28.9"'],
    "amem": ["-DAMEM", "-DNO_SUSPEND", "-DFAKE_VERSION=22705", '-DFAKE_VERSION_STR="2.27.5"'],
}
SUSPEND_OP, RESUME_OP = 0, 1


def _compile(out_dir: str, stem: str, sources: list, flags: list) -> str:
    """Compile once per folder: the name carries a digest of the sources and flags, so
    a folder kept between runs never serves an old build."""
    sha = hashlib.sha256(" ".join(flags).encode())
    for path in sources:
        with open(path, "rb") as source:
            sha.update(source.read())
    out_path = os.path.join(out_dir, f"{stem}-{sha.hexdigest()[:10]}.so")
    if os.path.exists(out_path):
        return out_path
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the fake NCCL tests need a C compiler: apt-get install gcc")
    tmp = out_path + f".{os.getpid()}.tmp"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", tmp,
                    *sources, *flags], check=True)
    os.replace(tmp, out_path)
    return out_path


def _folder(out_dir) -> str:
    out_dir = out_dir or os.environ.get("AMEM_FAKE_NCCL_DIR") or tempfile.mkdtemp(prefix="fake-nccl-")
    os.makedirs(out_dir, exist_ok=True)
    return out_dir


def build(variant: str = "suspend", out_dir: str = None) -> str:
    """Compile a variant once per folder and return the library path. The "runtime"
    variant also reaches a driver through dlsym as NCCL's static runtime does (see
    fake_nccl.c) and depends on the probe library (its RTLD_NEXT scope)."""
    out_dir = _folder(out_dir)
    if variant != "runtime":
        return _compile(out_dir, f"libnccl-fake-{variant}", [SOURCE], VARIANTS[variant])
    probe = _compile(out_dir, "libfake-probe", [PROBE], [])
    return _compile(out_dir, "libnccl-fake-runtime", [SOURCE],
                    ["-DRUNTIME", f"-L{out_dir}", "-Wl,--no-as-needed",
                     f"-l:{os.path.basename(probe)}", f"-Wl,-rpath,{out_dir}", "-ldl"])


def build_driver(out_dir: str = None) -> str:
    """The stand-in CUDA driver (fake_cuda.c) the runtime variant reaches."""
    return _compile(_folder(out_dir), "libcuda-fake", [DRIVER], [])


class FakeDriver:
    """What reached the stand-in driver: pins, unpins, registrations, bytes pinned now,
    bad frees."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.fakeCudaCount.restype = ctypes.c_long
        self.lib.fakeCudaCount.argtypes = (ctypes.c_int,)

    @property
    def pins(self) -> int:
        return self.lib.fakeCudaCount(0)

    @property
    def unpins(self) -> int:
        return self.lib.fakeCudaCount(1)

    @property
    def pinned_bytes(self) -> int:
        return self.lib.fakeCudaCount(2)

    @property
    def bad_frees(self) -> int:
        return self.lib.fakeCudaCount(3)

    @property
    def registers(self) -> int:
        return self.lib.fakeCudaCount(4)

    @property
    def unregisters(self) -> int:
        return self.lib.fakeCudaCount(5)


class FakeControls:
    """ctypes access to the fake library's test-only functions."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.fakeCommCreate.restype = ctypes.c_void_p
        self.lib.fakeCommCreate.argtypes = (ctypes.c_uint64, ctypes.c_uint64)
        argtypes = {
            "fakeCommInject": (ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int),
            "fakeCommPartial": (ctypes.c_void_p,),
            "fakeCommSetDelayUs": (ctypes.c_void_p, ctypes.c_int),
            "fakeCommSuspended": (ctypes.c_void_p,),
            "fakeCommCount": (ctypes.c_void_p, ctypes.c_int),
            "fakeCommSetGate": (ctypes.c_void_p,),
            "fakeCommOpenGate": (ctypes.c_void_p,),
            "fakeCommInSuspend": (ctypes.c_void_p,),
            "fakeCommGateTimedOut": (ctypes.c_void_p,),
            "fakeCommSetPeers": (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int),
            "fakeCommInBarrier": (ctypes.c_void_p,),
            "fakeCommPeerTimedOut": (ctypes.c_void_p,),
        }
        for name, types in argtypes.items():
            getattr(self.lib, name).argtypes = types

    def create(self, suspendable: int, persist: int = 4 << 20) -> int:
        return self.lib.fakeCommCreate(suspendable, persist)

    def inject(self, comm: int, op: int, code: int, times: int = 1) -> None:
        """The next ``times`` calls of ``op`` on ``comm`` return ``code``, where NCCL's
        own errors of that kind come (fake_nccl.c's header)."""
        self.lib.fakeCommInject(comm, op, code, times)

    def partial(self, comm: int) -> bool:
        """A suspend of ``comm`` failed after its members met: partly offloaded."""
        return bool(self.lib.fakeCommPartial(comm))

    def delay(self, comm: int, microseconds: int) -> None:
        self.lib.fakeCommSetDelayUs(comm, microseconds)

    def suspended(self, comm: int) -> bool:
        return bool(self.lib.fakeCommSuspended(comm))

    def amem_paused(self) -> bool:
        """The AMem build's process-wide pause (False for the other builds)."""
        paused = getattr(self, "_amem_paused", None)
        if paused is None:
            try:
                paused = self.lib.fakeAmemPaused
            except AttributeError:
                paused = False
            self._amem_paused = paused
        return bool(paused()) if paused else False

    def suspend(self, comm: int) -> int:
        """ncclCommSuspend(comm, 1) as the package calls it; returns the result code."""
        fn = self.lib.ncclCommSuspend
        fn.argtypes = (ctypes.c_void_p, ctypes.c_int)
        return fn(comm, 1)

    def resume(self, comm: int) -> int:
        fn = self.lib.ncclCommResume
        fn.argtypes = (ctypes.c_void_p,)
        return fn(comm)

    def count(self, comm: int, op: int) -> int:
        return self.lib.fakeCommCount(comm, op)

    def set_gate(self, comm: int) -> None:
        """The next suspend of ``comm`` waits until a Python thread calls :meth:`open_gate`."""
        self.lib.fakeCommSetGate(comm)

    def open_gate(self, comm: int) -> None:
        self.lib.fakeCommOpenGate(comm)

    def in_suspend(self, comm: int) -> bool:
        return bool(self.lib.fakeCommInSuspend(comm))

    def gate_timed_out(self, comm: int) -> bool:
        return bool(self.lib.fakeCommGateTimedOut(comm))

    def set_peers(self, comm: int, folder: str, rank: int, count: int) -> None:
        """``comm``'s suspends and resumes wait for its ``count`` members, as NCCL's
        do: each member marks a round in ``folder`` (shared by the group's ranks, new
        for each job) and waits for the others' marks."""
        os.makedirs(folder, exist_ok=True)
        self.lib.fakeCommSetPeers(comm, folder.encode(), rank, count)

    def in_barrier(self, comm: int) -> bool:
        """A suspend or resume of ``comm`` is waiting for a member that has not come."""
        return bool(self.lib.fakeCommInBarrier(comm))

    def peer_timed_out(self, comm: int) -> bool:
        """A wait for a member ran past FAKE_NCCL_PEER_WAIT_S (NCCL would still wait)."""
        return bool(self.lib.fakeCommPeerTimedOut(comm))

    # --- the runtime variant ("runtime"): NCCL's host backup through the driver ---
    def set_backup(self, comm: int, entries: int, entry_bytes: int) -> None:
        """``comm``'s suspends back up ``entries`` blocks of ``entry_bytes`` through the
        driver (pin, zero, copy), its resumes copy back and unpin, as NCCL's do."""
        self.lib.fakeCommSetBackup.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
        self.lib.fakeCommSetBackup(comm, entries, entry_bytes)

    def image(self, comm: int, nbytes: int):
        """The communicator's "device" bytes, writable (a ctypes byte array)."""
        self.lib.fakeCommImage.restype = ctypes.c_void_p
        self.lib.fakeCommImage.argtypes = (ctypes.c_void_p,)
        return (ctypes.c_ubyte * nbytes).from_address(self.lib.fakeCommImage(comm))

    def runtime_state(self) -> int:
        """0: its runtime has not reached the driver yet; 1: it has; -1: it failed."""
        return self.lib.fakeRuntimeState()

    def next_lookup(self, name: str) -> int:
        """The address ``dlsym(RTLD_NEXT, name)`` gives when the stand-in NCCL asks."""
        self.lib.fakeNextLookup.restype = ctypes.c_void_p
        self.lib.fakeNextLookup.argtypes = (ctypes.c_char_p,)
        return self.lib.fakeNextLookup(name.encode()) or 0
