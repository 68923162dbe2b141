"""Where every rank runs (host, GPU), learned once at set-up over the c10d store.

Two things depend on it. Several ranks can share one GPU (NCCL >= 2.30 with
NCCL_MULTI_RANK_GPU_ENABLE=1): ``cudaMemGetInfo`` then sees every sharing
rank's memory, so a report must say its device figures are device-wide. And
a group whose ranks sit on several hosts talks over the network transport,
whose buffers NCCL keeps (persistent) or holds in host memory: such a group
frees little, and its report says why.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

PLACEMENT_KEY = "__placement__"


def host_id() -> str:
    """The host as NCCL sees it: NCCL_HOSTID when set (simulated nodes), else the hostname."""
    return os.environ.get("NCCL_HOSTID") or socket.gethostname()


def device_id(device: Optional[int]) -> str:
    """A GPU's identity across processes (its UUID), or "cpu"."""
    if device is None:
        return "cpu"
    import torch  # light import: torch at use

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid is not None else f"cuda:{device}"


@dataclass(frozen=True)
class Placement:
    """Host and device of every rank; missing ranks (late, dead) are absent."""

    rank: int
    hosts: dict
    devices: dict

    def sharing_my_device(self) -> int:
        """Ranks of this job on this rank's GPU, itself included (1 on CPU)."""
        mine = (self.hosts.get(self.rank), self.devices.get(self.rank))
        if mine[1] in (None, "cpu"):
            return 1
        return sum(1 for r in self.hosts if (self.hosts[r], self.devices.get(r)) == mine)

    def host_count(self, ranks) -> int:
        return len({self.hosts[r] for r in ranks if r in self.hosts})

    def transport(self, ranks) -> str:
        count = self.host_count(ranks)
        return "intra-node" if count <= 1 else f"network ({count} hosts)"


def exchange(agreement, world: tuple, rank: int, device: Optional[int]) -> Placement:
    """Collective over all ranks (bounded by the agreement's timeout)."""
    value = f"{host_id()}|{device_id(device)}"
    seen = agreement.exchange({PLACEMENT_KEY: (world, value)})[PLACEMENT_KEY]
    hosts, devices = {}, {}
    for r, v in seen.items():
        if v is not None:
            hosts[r], devices[r] = v.split("|", 1)
    return Placement(rank=rank, hosts=hosts, devices=devices)
