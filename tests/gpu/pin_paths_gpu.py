"""Which host memory should hold a suspend's backup: how long each kind takes to get,
to copy into and back, and how much the process's GPU work slows beside it?

NCCL's suspend pins a fresh host block for every buffer it offloads (cudaHostAlloc,
zeroed), copies the buffer into it, and its resume copies it back and unpins it. The
package keeps those blocks from one resume to the next suspend (csrc/backup_pool.c), so
only the first cycle pins; but while it pins, the process's GPU work stands still
(results/one_h200/suspend_stall: x1.37-1.59 for 1.8 s of pinning). This measures one
suspend-and-resume's host side per kind of block, with no NCCL (cudaMemcpy of each piece
from and to one device buffer, as NCCL's suspend and resume do), beside steps of GPU work
(suspend_stall_gpu's engine steps):

- ``pinned_fresh``: cudaHostAlloc(mapped) and memset, copy out, copy in, cudaFreeHost:
  NCCL's own cycle, and the package's first;
- ``pinned_kept``: the blocks pinned beforehand (not timed), copies only: the package's
  later cycles;
- ``registered_fresh``: pages got and zeroed by the kernel first (mmap, MAP_POPULATE: no
  CUDA call), then cudaHostRegister(mapped); unregistered and unmapped at the end;
- ``pageable_fresh``: the same pages, never pinned: cudaMemcpy stages through the
  driver's own pinned buffers;
- ``pageable_kept``: those pages got beforehand, copies only.

Each mode reports the seconds per GiB of each part (get, copy_out, copy_in, release) and
the work's time against the baseline's (the same steps with nothing beside them,
measured first and last). What it decides: whether the first cycle can avoid pinning
(and its stall), and whether kept pageable blocks would do for every cycle.

Command (the image's torch, one GPU, no NCCL):
    PYTHONPATH=. python3 tests/gpu/pin_paths_gpu.py OUT.json [GIB] [PIECE_MIB] [ROUNDS]
CPU check of this script (no card: the CUDA calls are left out, copies are memcpy):
    PYTHONPATH=. AMEM_GPU_DRIVER_ON_CPU=1 python3 tests/gpu/pin_paths_gpu.py /tmp/p.json 0.05 4 1
"""

from __future__ import annotations

import contextlib
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

CUDA_HOST_ALLOC_MAPPED = 2      # cudaHostAllocMapped, what NCCL's backup asks for
CUDA_HOST_REGISTER_MAPPED = 2   # cudaHostRegisterMapped
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
BASELINE_S = 0.3 if ON_CPU else 3.0

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long)
libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
libc.memset.restype = ctypes.c_void_p
libc.memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
libc.memcpy.restype = ctypes.c_void_p
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


MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST = 1, 2
#: mode -> (kind of block, got before the timing)
MODE_BLOCKS = {"pinned_fresh": ("pinned", False), "pinned_kept": ("pinned", True),
               "registered_fresh": ("registered", False),
               "pageable_fresh": ("pageable", False), "pageable_kept": ("pageable", True)}
MODES = tuple(MODE_BLOCKS)


def get_block(kind: str, cudart: Cudart, size: int) -> int:
    """A host block of ``kind``, zeroed (NCCL zeroes each backup it pins)."""
    if kind == "pinned" and cudart.lib is not None:
        ptr = ctypes.c_void_p()
        cudart.call("cudaHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(size),
                    CUDA_HOST_ALLOC_MAPPED)
        libc.memset(ptr, 0, size)
        return ptr.value
    address = _mmap(size, populate=True)  # the kernel's zeroed pages, no CUDA call
    if kind == "registered":
        cudart.call("cudaHostRegister", ctypes.c_void_p(address), ctypes.c_size_t(size),
                    CUDA_HOST_REGISTER_MAPPED)
    return address


def release_block(kind: str, cudart: Cudart, address: int, size: int) -> None:
    if kind == "pinned" and cudart.lib is not None:
        cudart.call("cudaFreeHost", ctypes.c_void_p(address))
        return
    if kind == "registered":
        cudart.call("cudaHostUnregister", ctypes.c_void_p(address))
    libc.munmap(address, size)


def copy(cudart: Cudart, dst: int, src: int, size: int, kind: int) -> None:
    """cudaMemcpy, as NCCL's suspend (device to host) and resume (host to device) call it;
    a host memcpy on CPU."""
    if cudart.lib is None:
        libc.memcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(size))
    else:
        cudart.call("cudaMemcpy", ctypes.c_void_p(dst), ctypes.c_void_p(src),
                    ctypes.c_size_t(size), kind)


def sizes_of(nbytes: int, piece: int) -> list:
    return [min(piece, nbytes - at) for at in range(0, nbytes, piece)]


def cycle(mode: str, cudart: Cudart, device_ptr: int, sizes: list, kept: list) -> dict:
    """One suspend and resume of ``sizes`` through blocks of the mode's kind; ``kept``: the
    blocks got beforehand (kept modes), else they are got and released here."""
    kind, _ = MODE_BLOCKS[mode]
    parts = dict.fromkeys(("get", "copy_out", "copy_in", "release"), 0.0)
    blocks = list(kept)
    for i, size in enumerate(sizes):  # the suspend: a block, then the copy into it
        if not kept:
            t = time.monotonic()
            blocks.append(get_block(kind, cudart, size))
            parts["get"] += time.monotonic() - t
        t = time.monotonic()
        copy(cudart, blocks[i], device_ptr, size, MEMCPY_DEVICE_TO_HOST)
        parts["copy_out"] += time.monotonic() - t
    for i, size in enumerate(sizes):  # the resume: the copy back, then the block freed
        t = time.monotonic()
        copy(cudart, device_ptr, blocks[i], size, MEMCPY_HOST_TO_DEVICE)
        parts["copy_in"] += time.monotonic() - t
        if not kept:
            t = time.monotonic()
            release_block(kind, cudart, blocks[i], size)
            parts["release"] += time.monotonic() - t
    return parts


def work_beside(mode, cudart, x, count, device_ptr, sizes) -> dict:
    """Steps of GPU work: ``count`` of them alone (mode None, the baseline), else as many
    as fit while a thread runs the mode's cycle; their rate, steps a second."""
    out = {}
    kind, beforehand = MODE_BLOCKS.get(mode, (None, False))
    kept = [get_block(kind, cudart, size) for size in sizes] if beforehand else []

    def run_cycle():
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            t = time.monotonic()
            out["parts"] = cycle(mode, cudart, device_ptr, sizes, kept)
            out["cycle_s"] = time.monotonic() - t

    thread = threading.Thread(target=run_cycle) if mode else None
    steps = []
    began = time.monotonic()
    if thread:
        thread.start()
        while thread.is_alive() or not steps:  # the work goes on as long as the cycle
            steps += run_steps(x, 1, step=engine_step)
        thread.join()
    else:
        steps = run_steps(x, count, step=engine_step)
    work_s = steps[-1][1] - began
    for address, size in zip(kept, sizes):
        release_block(kind, cudart, address, size)
    out.update(work_s=work_s, steps=len(steps), rate=len(steps) / work_s,
               step_s_max=max(e - b for b, e in steps))
    return out


def main() -> None:
    path = sys.argv[1]
    gib = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    piece = int(float(sys.argv[3] if len(sys.argv) > 3 else 4) * 2**20)
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    nbytes = int(gib * 2**30)
    device = torch.device("cpu" if ON_CPU else "cuda:0")
    x = torch.ones(4096, device=device)
    cudart = Cudart()
    piece = min(piece, nbytes)
    source = torch.ones(piece, dtype=torch.uint8, device=device)  # the buffer NCCL offloads
    sizes = sizes_of(nbytes, piece)
    run_steps(x, 50)  # warm-up
    began, n = time.monotonic(), 0
    while time.monotonic() - began < BASELINE_S:
        run_steps(x, 10)
        n += 10
    results = {m: [] for m in (None,) + MODES}
    for _ in range(rounds):
        for mode in (None,) + MODES:
            results[mode].append(work_beside(mode, cudart, x, n, source.data_ptr(), sizes))
    results[None].append(work_beside(None, cudart, x, n, source.data_ptr(), sizes))
    baseline = statistics.median(r["rate"] for r in results[None])
    summary = {}
    for mode in MODES:
        rows = results[mode]
        parts = {k: statistics.median(r["parts"][k] for r in rows) / gib for k in rows[0]["parts"]}
        cycle_s = statistics.median(r["cycle_s"] for r in rows)
        rate = statistics.median(r["rate"] for r in rows) / baseline
        summary[mode] = {
            "seconds_per_gib": {k: round(v, 4) for k, v in parts.items()},
            "cycle_s_per_gib": round(cycle_s / gib, 4),
            # 1.0: the work went on at its own pace; the stall is the cycle's time it lost
            "work_rate_vs_baseline": round(rate, 3),
            "work_lost_s_per_gib": round(cycle_s * max(0.0, 1 - rate) / gib, 4),
            "step_s_max": round(max(r["step_s_max"] for r in rows), 4)}
    record = {"gib": gib, "piece_mib": piece / 2**20, "rounds": rounds, "steps": n,
              "baseline_steps_per_s": round(baseline, 2), "modes": summary, "on_cpu": ON_CPU,
              **provenance("tests/gpu/pin_paths_gpu.py"), "machine": machine(),
              "raw": {str(k): v for k, v in results.items()}}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: record[k] for k in ("gib", "piece_mib", "baseline_steps_per_s", "modes")},
                     indent=1))


if __name__ == "__main__":
    main()
