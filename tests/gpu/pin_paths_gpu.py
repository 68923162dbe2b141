"""Which way of pinning host memory stalls a process's GPU work the least?

A suspend's first cycle pins its host backup afresh (the kept backup serves every later
one), and while it pins, the process's GPU work stands still (results/one_h200/
suspend_stall: x1.37-1.59 for 1.8 s of pinning). cudaHostAlloc does two things at once,
under the driver: it gets zeroed pages from the kernel and maps them for the GPU. Only
the second needs the driver. This measures, with no NCCL, how long each part takes and
how much steps of GPU work (suspend_stall_gpu's engine steps) slow down beside it:

- ``host_alloc``: cudaHostAlloc(mapped) and memset per piece, as NCCL's suspend does,
  then cudaFreeHost;
- ``register``: the pages got and touched first (mmap with MAP_POPULATE: the kernel
  zeroes them, no CUDA call), then cudaHostRegister(mapped); cudaHostUnregister, munmap;
- ``register_huge``: the same on transparent huge pages (madvise, then touched).

Each mode reports the seconds per GiB of each part, and the work's time against the
baseline's (the same steps with nothing beside them, measured first and last). If
``register``'s driver part is short and its populating does not stall, the hook's fresh
pins could be made that way, the populating outside the driver.

Command (the image's torch, one GPU, no NCCL):
    PYTHONPATH=. python3 tests/gpu/pin_paths_gpu.py OUT.json [GIB] [PIECE_MIB] [ROUNDS]
CPU check of this script (no card: each mode's CUDA calls are left out, said so):
    PYTHONPATH=. AMEM_GPU_DRIVER_ON_CPU=1 python3 tests/gpu/pin_paths_gpu.py /tmp/p.json 0.05 4 1
"""

from __future__ import annotations

import ctypes
import json
import mmap
import statistics
import sys
import threading
import time

import torch

from tests.gpu.common import ON_CPU, machine, provenance
from tests.gpu.suspend_stall_gpu import _loaded, engine_step, run_steps

MODES = ("host_alloc", "register", "register_huge")
CUDA_HOST_ALLOC_MAPPED = 2      # cudaHostAllocMapped, what NCCL's backup asks for
CUDA_HOST_REGISTER_MAPPED = 2   # cudaHostRegisterMapped
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
BASELINE_S = 0.3 if ON_CPU else 3.0

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long)
libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
libc.memset.restype = ctypes.c_void_p
MAP_FAILED = ctypes.c_void_p(-1).value


class Cudart:
    """The few runtime calls, through torch's own libcudart (ctypes: the GIL is released)."""

    def __init__(self):
        self.lib = None if ON_CPU else ctypes.CDLL(_loaded("libcudart"))

    def call(self, name: str, *args) -> None:
        if self.lib is None:
            return
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed: cudaError {code}")


def _mmap(size: int, populate: bool) -> int:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_POPULATE if populate else 0)
    ptr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if ptr in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return ptr


def pin_and_free(mode: str, cudart: Cudart, nbytes: int, piece: int) -> dict:
    """Pin ``nbytes`` in pieces the way ``mode`` says, then free them; each part's seconds."""
    parts = {"populate": 0.0, "driver_pin": 0.0, "driver_unpin": 0.0, "unmap": 0.0}
    held = []
    sizes = [min(piece, nbytes - at) for at in range(0, nbytes, piece)]
    try:
        for size in sizes:
            if mode == "host_alloc":
                ptr = ctypes.c_void_p()
                t = time.monotonic()
                if cudart.lib is None:
                    ptr = ctypes.c_void_p(_mmap(size, populate=False))
                else:
                    cudart.call("cudaHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(size),
                                CUDA_HOST_ALLOC_MAPPED)
                parts["driver_pin"] += time.monotonic() - t
                t = time.monotonic()
                libc.memset(ptr, 0, size)  # NCCL zeroes each backup (ncclCudaHostCalloc)
                parts["populate"] += time.monotonic() - t
                held.append((ptr.value, size))
                continue
            t = time.monotonic()
            huge = mode == "register_huge"
            address = _mmap(size, populate=not huge)
            if huge:
                libc.madvise(address, size, MADV_HUGEPAGE)
                libc.memset(address, 0, size)  # touched: the pages exist before the driver
            parts["populate"] += time.monotonic() - t
            held.append((address, size))
            t = time.monotonic()
            cudart.call("cudaHostRegister", ctypes.c_void_p(address), ctypes.c_size_t(size),
                        CUDA_HOST_REGISTER_MAPPED)
            parts["driver_pin"] += time.monotonic() - t
    finally:
        for address, size in held:
            t = time.monotonic()
            if mode == "host_alloc" and cudart.lib is not None:
                cudart.call("cudaFreeHost", ctypes.c_void_p(address))
                parts["driver_unpin"] += time.monotonic() - t
                continue
            if mode != "host_alloc":
                cudart.call("cudaHostUnregister", ctypes.c_void_p(address))
            parts["driver_unpin"] += time.monotonic() - t
            t = time.monotonic()
            libc.munmap(address, size)
            parts["unmap"] += time.monotonic() - t
    return parts


def work_beside(mode, cudart, x, count, nbytes, piece) -> dict:
    """The steps, and (mode not None) a thread pinning and freeing beside them."""
    out = {}

    def pin():
        with torch.cuda.device(x.device) if x.is_cuda else _nothing():
            out["parts"] = pin_and_free(mode, cudart, nbytes, piece)

    thread = threading.Thread(target=pin) if mode else None
    began = time.monotonic()
    if thread:
        thread.start()
    steps = run_steps(x, count, step=engine_step)
    work_s = time.monotonic() - began
    if thread:
        thread.join()
    out.update(work_s=work_s, step_s_max=max(e - b for b, e in steps))
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    path = sys.argv[1]
    gib = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    piece = int(float(sys.argv[3] if len(sys.argv) > 3 else 4) * 2**20)
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    nbytes = int(gib * 2**30)
    device = torch.device("cpu" if ON_CPU else "cuda:0")
    x = torch.ones(4096, device=device)
    cudart = Cudart()
    run_steps(x, 50)  # warm-up
    began, n = time.monotonic(), 0
    while time.monotonic() - began < BASELINE_S:
        run_steps(x, 10)
        n += 10
    results = {m: [] for m in (None,) + MODES}
    for _ in range(rounds):
        for mode in (None,) + MODES:
            results[mode].append(work_beside(mode, cudart, x, n, nbytes, piece))
    results[None].append(work_beside(None, cudart, x, n, nbytes, piece))
    baseline = statistics.median(r["work_s"] for r in results[None])
    summary = {}
    for mode in MODES:
        parts = {k: statistics.median(r["parts"][k] for r in results[mode]) / gib
                 for k in results[mode][0]["parts"]}
        summary[mode] = {
            "seconds_per_gib": {k: round(v, 4) for k, v in parts.items()},
            "work_vs_baseline": round(statistics.median(r["work_s"] for r in results[mode])
                                      / baseline, 3),
            "step_s_max": round(max(r["step_s_max"] for r in results[mode]), 4)}
    record = {"gib": gib, "piece_mib": piece / 2**20, "rounds": rounds, "steps": n,
              "baseline_work_s": round(baseline, 4), "modes": summary, "on_cpu": ON_CPU,
              **provenance("tests/gpu/pin_paths_gpu.py"), "machine": machine(),
              "raw": {str(k): v for k, v in results.items()}}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: record[k] for k in ("gib", "piece_mib", "baseline_work_s", "modes")},
                     indent=1))


if __name__ == "__main__":
    main()
