"""Objects shaped like the NCCL backend object ``group._get_backend(cuda)`` returns
on each torch users run, over a fake NCCL communicator.

Shapes read from the torch 2.11-2.15 wheels (class names and methods; see
``amem_callbacks/backends/torch_comms.py``). torch's own ``suspend()`` holds the
GIL for the whole NCCL call; the stand-ins reproduce that by calling the fake
library through ``ctypes.PyDLL``, which keeps the GIL, unlike ``CDLL``.
"""

from __future__ import annotations

import ctypes

TORCH_SHAPES = ("2.11", "2.12-2.14", "2.14-nccl2", "2.15-nccl2", "2.15-nccl-lazy",
                "2.15-nccl-legacy")


class _TorchMethods:
    """``suspend``/``resume``/``memory_stats`` as torch >= 2.12 binds them."""

    def __init__(self, library_path: str, comm: int, pair_comms=()):
        self._gil_holding = ctypes.PyDLL(library_path)
        self._stats = ctypes.CDLL(library_path).ncclCommMemStats
        self._stats.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64))
        self.comm = comm
        self.pair_comms = list(pair_comms)
        self.calls = []

    def _all(self):
        return [self.comm] + self.pair_comms

    def suspend(self):
        self.calls.append("suspend")
        fn = self._gil_holding.ncclCommSuspend
        fn.argtypes = (ctypes.c_void_p, ctypes.c_int)
        for comm in self._all():
            if fn(comm, 1) != 0:
                raise RuntimeError("NCCL Suspend failed")

    def resume(self):
        self.calls.append("resume")
        fn = self._gil_holding.ncclCommResume
        fn.argtypes = (ctypes.c_void_p,)
        for comm in self._all():
            if fn(comm) != 0:
                raise RuntimeError("NCCL Resume failed")

    def memory_stats(self):
        out = {"suspend": 0, "suspended": 0, "persist": 0, "total": 0}
        for comm in self._all():  # nccl-lazy sums its primary and pair communicators
            for key, stat in (("suspend", 0), ("suspended", 1), ("persist", 2), ("total", 3)):
                value = ctypes.c_uint64()
                self._stats(comm, stat, ctypes.byref(value))
                out[key] += value.value
        return out


class _Pointer:
    def __init__(self, comm: int):
        self.ptr = comm

    def _comm_ptr(self):
        return self.ptr


def make(shape: str, library_path: str, comm: int, pair_comms=()):
    """A torch backend object of ``shape`` (one of TORCH_SHAPES) over ``comm``."""
    if shape == "2.11":
        cls = type("ProcessGroupNCCL", (_Pointer,), {})
        return cls(comm)
    if shape in ("2.12-2.14", "2.15-nccl-legacy"):
        cls = type("ProcessGroupNCCL", (_Pointer, _TorchMethods), {
            "__init__": lambda self, lib, c: (_Pointer.__init__(self, c),
                                              _TorchMethods.__init__(self, lib, c))[0]})
        return cls(library_path, comm)
    if shape == "2.14-nccl2":  # nccl2 in 2.14: torch's methods, no pointer
        cls = type("ProcessGroupNCCL2", (_TorchMethods,), {})
        return cls(library_path, comm)
    if shape == "2.15-nccl2":
        cls = type("ProcessGroupNCCL2", (_Pointer, _TorchMethods), {
            "__init__": lambda self, lib, c: (_Pointer.__init__(self, c),
                                              _TorchMethods.__init__(self, lib, c))[0],
            "comm_ptr": property(lambda self: self.ptr)})
        return cls(library_path, comm)
    if shape == "2.15-nccl-lazy":
        cls = type("ProcessGroupNCCLLazy", (_Pointer, _TorchMethods), {
            "__init__": lambda self, lib, c, pairs: (_Pointer.__init__(self, c),
                                                     _TorchMethods.__init__(self, lib, c, pairs))[0]})
        return cls(library_path, comm, pair_comms)
    raise ValueError(f"unknown torch shape {shape!r}: one of {TORCH_SHAPES}")


class ProcessGroupGloo:
    """gloo under torch >= 2.12: ``suspend`` exists on every Backend and raises."""

    def name(self):
        return "gloo"

    def suspend(self):
        raise RuntimeError("Backend gloo does not support suspend")

    resume = memory_stats = suspend


class _ProcessGroupWrapper:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: the NCCL backend sits behind ``wrapped_pg``."""

    def __init__(self, inner):
        self.wrapped_pg = inner

    def name(self):
        return "nccl"

    def suspend(self):
        raise AssertionError("the wrapper must be looked through, not suspended")
