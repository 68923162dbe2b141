"""How many ranks the tools start on the GPUs this machine has, on which device
each, and how their rank processes hand each other small figures.

NCCL >= 2.30 runs several ranks of one communicator on one GPU when
``NCCL_MULTI_RANK_GPU_ENABLE=1`` (2 and 8 ranks on one card ran every suspend,
resume and collective exact: docs/evidence.md); 2.29.x refuses it ("Multiple Ranks are
using the same GPU"). So one GPU can show the real thing, with this caveat:
memory and time are then shared-GPU figures (every rank's buffers sit on the
same device, and the ranks' transitions compete for it).
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass, field
from typing import Optional

from ..availability import is_cuda_available
from ..backends import create_backend
from ..errors import BackendUnavailable
from ..nccl_library import NcclLibrary, version_string

MULTI_RANK_MIN_VERSION = (2, 30, 0)
MULTI_RANK_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: how far below the ephemeral range free_port looks
PORTS_BELOW_EPHEMERAL = 12000


def free_port(tries: int = 64) -> int:
    """A TCP port free on this host now, for a c10d store the tools start (the one
    helper of the package, the tests and the GPU drivers).

    Drawn below the kernel's ephemeral range: a port the kernel hands out (bind to
    0) is also what it gives the next outgoing connection, and with dozens of gloo
    ranks connecting, one took a store's port between this call and torchrun's
    bind (EADDRINUSE in CI). Where the range is unknown, or nothing below it binds,
    the kernel's choice."""
    import random

    low = _ephemeral_low()
    if low is not None and low > 1024 + 64:
        draw = random.SystemRandom()
        for _ in range(tries):
            port = draw.randrange(max(1024, low - PORTS_BELOW_EPHEMERAL), low)
            if _binds(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> Optional[int]:
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _binds(port: int) -> bool:
    """Whether a store could listen on ``port`` now (every address, as torch's does)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def gather_ints(values: list, group) -> list:
    """Collective over ``group``: every rank's list of ints (same length on all).

    Plain int64 tensors, not ``all_gather_object``: torch's object collectives
    need numpy, which a fresh ``pip install torch`` does not bring."""
    # light import: torch (both). The tests' harness and the GPU drivers import
    # this module for free_port before torch, and the tools quiet numpy first.
    import torch
    import torch.distributed as dist  # light import: torch in the workers only

    mine = torch.tensor(list(values), dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


_NUMPY_WARNING = "Failed to initialize NumPy"


def quiet_missing_numpy() -> None:
    """Before torch is imported: without numpy (a fresh ``pip install torch``) torch
    warns about it in every process, though the tools do not need it. The rule
    goes into PYTHONWARNINGS too, for the rank processes torch starts."""
    warnings.filterwarnings("ignore", message=_NUMPY_WARNING, category=UserWarning)
    rule = f"ignore:{_NUMPY_WARNING}:UserWarning"
    current = os.environ.get("PYTHONWARNINGS", "")
    if rule not in current:
        os.environ["PYTHONWARNINGS"] = f"{current},{rule}" if current else rule


def local_device(local_rank: int) -> int:
    """The GPU of a local rank: round robin over the visible GPUs."""
    import torch  # light import: torch (see gather_ints)

    return local_rank % max(1, torch.cuda.device_count())


@dataclass
class Layout:
    """Ranks to start and how, or why they cannot start on the GPUs here."""

    ranks: int
    gpus: int
    env: dict = field(default_factory=dict)  # to set before the ranks start
    refused: Optional[str] = None  # why several ranks cannot share a GPU here, with the fix

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0 and self.refused is None

    @property
    def ranks_per_gpu(self) -> int:
        return -(-self.ranks // self.gpus) if self.gpus else 0

    def describe(self) -> str:
        if not self.on_gpu:
            return f"{self.ranks} CPU processes, gloo"
        if self.ranks_per_gpu > 1:
            return (f"{self.ranks} ranks on {self.gpus} GPU(s), up to {self.ranks_per_gpu} per "
                    "GPU: real NCCL suspend, but memory and time are shared-GPU figures, not "
                    "what one rank on its own GPU would see")
        return f"{self.ranks} ranks on {self.gpus} GPU(s), one per GPU, NCCL"


def plan_ranks(requested: Optional[int] = None) -> Layout:
    """At least 2 ranks (a communicator needs peers to hold buffers), default one per GPU."""
    import torch  # light import: torch, after the tools' quiet_missing_numpy()

    gpus = torch.cuda.device_count() if is_cuda_available() else 0
    ranks = requested or max(2, gpus)
    if gpus == 0 or ranks <= gpus:
        return Layout(ranks=ranks, gpus=gpus)
    lib = NcclLibrary.loaded()
    if lib is None or lib.version < MULTI_RANK_MIN_VERSION:
        found = f"NCCL {lib.version_str}" if lib else "no NCCL"
        return Layout(ranks=ranks, gpus=gpus, refused=(
            f"{ranks} ranks on {gpus} GPU(s) need several ranks per GPU, which {found} refuses "
            f"(NCCL >= {version_string(MULTI_RANK_MIN_VERSION)} allows it). Fix: pip install -U "
            f"'nvidia-nccl-cu13>={version_string(MULTI_RANK_MIN_VERSION)}', or --ranks {gpus}"))
    return Layout(ranks=ranks, gpus=gpus, env=dict(MULTI_RANK_ENV))


#: torch.distributed backends a tool may build its NCCL groups with: torch 2.15 made
#: "nccl" mean ProcessGroupNCCL2 and added the other names (older torch: "nccl" only)
TORCH_NCCL_BACKENDS = ("nccl", "nccl2", "nccl-lazy", "nccl-legacy")


def torch_backend_refusal(name: Optional[str], on_gpu: bool) -> Optional[str]:
    """Why ``--torch-backend name`` cannot run here, in one line, or None."""
    if name is None:
        return None
    if not on_gpu:
        return (f"--torch-backend {name} builds NCCL groups and this machine has no GPU: "
                "leave it out for the CPU dry run (gloo)")
    import torch.distributed as dist

    if not dist.is_backend_available(name):
        import torch

        return (f"--torch-backend {name}: torch {torch.__version__} has no such backend "
                "(nccl2, nccl-lazy and nccl-legacy came with torch 2.15): leave it out for "
                "'nccl'")
    return None


def backend_refusal(name: Optional[str], on_gpu: bool) -> Optional[str]:
    """Why a backend the tool was asked for by name cannot work here, in one
    line, or None. The library degrades to running unchanged (fail safe); a tool
    run to show a backend must say so and stop instead, before ranks start."""
    if name in (None, "auto", "noop"):
        return None
    if not on_gpu:
        return (f"--backend {name} needs GPUs with NCCL and this machine has none: leave "
                "--backend out for the CPU dry run (noop)")
    try:
        create_backend(name).check()
    except BackendUnavailable as exc:
        return (f"--backend {name} cannot work here: {exc.reason} (`amem-callbacks doctor` "
                "says how to fix it)")
    return None
