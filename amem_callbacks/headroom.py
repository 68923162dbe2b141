"""What the freed memory is worth to a vLLM rollout: the setting that uses it.

vLLM sizes its KV cache once, at start-up, from ``gpu_memory_utilization``
(a share of the GPU's total memory, checked against the memory free then),
and its sleep/wake-up keeps that size. So the package cannot grow a vLLM
cache by itself: vLLM starts before the first rollout, when every NCCL
communicator is still allocated, and an automatic raise would have to
restart the engine. What it can do is tell the user, from the first begin,
how far the setting can go with the communicators suspended during rollout:
the GPU's total memory is known, and so are the bytes the begin freed on it.

The freed bytes alone overstate it once the share already uses them: at a share
raised past what fits without the package, NCCL still frees as much, but vLLM
holds most of it. So where the adapter can read the free memory at the
rollout's fullest (TRL colocated: after vLLM's generate, before its sleep), the
raise is also bounded by that reading, and a later rollout's lower figure
revises the line (the first rollout runs before the optimizer's state exists).
Following the freed bytes alone, the line once suggested a share that needed more
than the GPU had left free at the rollout's fullest (docs/evidence.md, "Where the
constants come from").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .availability import is_cuda_available, loaded_torch
from .log import logger

#: left out of the freed bytes: vLLM checks free memory against its share at wake-up
DEFAULT_MARGIN_BYTES = 512 * 2**20
#: vLLM refuses 1.0; keep the suggestion below it
CEILING = 0.98


@dataclass(frozen=True)
class Headroom:
    """How far ``setting`` can be raised with the freed bytes."""

    setting: str
    current: float
    suggested: float
    freed_bytes: int
    total_bytes: int
    margin_bytes: int
    #: this rank's free memory at the rollout's fullest with the groups suspended
    #: (None where the adapter cannot read it: the freed bytes alone bound the raise)
    room_bytes: Optional[int] = None

    @property
    def limited_by_room(self) -> bool:
        return self.room_bytes is not None and self.room_bytes < self.freed_bytes

    def line(self) -> str:
        gib = 2**30
        if self.suggested <= self.current:
            if self.limited_by_room:
                return (f"{self.setting} {self.current:g} already uses the NCCL memory suspended "
                        f"during rollout: {self.room_bytes / gib:.2f} GiB stay free at its fullest "
                        f"on this rank (margin {self.margin_bytes / gib:.2f} GiB); do not raise it")
            return (f"the suspended NCCL memory ({self.freed_bytes / gib:.2f} GiB on this GPU) "
                    f"is too small to raise {self.setting} from {self.current:g} "
                    f"(margin {self.margin_bytes / gib:.2f} GiB)")
        line = (f"{self.freed_bytes / gib:.2f} GiB of NCCL memory is free on this GPU during "
                f"rollout: you can raise {self.setting} from {self.current:g} to "
                f"{self.suggested:g} (of {self.total_bytes / gib:.1f} GiB, "
                f"{self.margin_bytes / gib:.2f} GiB margin)")
        if self.limited_by_room:
            line += (f"; no further: {self.room_bytes / gib:.2f} GiB stay free at the rollout's "
                     "fullest on this rank")
        return line

    def as_dict(self, prefix: str = "amem/") -> dict:
        p = prefix + "headroom/"
        out = {p + "freed_bytes": self.freed_bytes, p + "gpu_memory_utilization": self.suggested,
               p + "gpu_memory_utilization_now": self.current}
        if self.room_bytes is not None:
            out[p + "room_bytes"] = self.room_bytes
        return out


#: the suggestion is rounded down to this step: vLLM takes any float, and 0.01 of
#: a large card's memory is more than one DDP communicator frees
STEP = 1e-4


def vllm_headroom(setting: str, current: float, freed_bytes: int, total_bytes: int,
                  margin_bytes: int = DEFAULT_MARGIN_BYTES,
                  room_bytes: Optional[int] = None) -> Optional[Headroom]:
    """The utilisation ``current`` plus the share of what the freed bytes leave
    free (no more than ``room_bytes``, where known), less the margin, rounded down
    to :data:`STEP`; None when a figure is missing."""
    if not total_bytes or current is None or freed_bytes is None:
        return None
    room = freed_bytes if room_bytes is None else min(freed_bytes, max(0, room_bytes))
    usable = max(0, room - margin_bytes)
    suggested = round(math.floor((current + usable / total_bytes) / STEP) * STEP, 4)
    suggested = max(current, min(CEILING, suggested))
    return Headroom(setting, float(current), suggested, int(freed_bytes), int(total_bytes),
                    int(margin_bytes), None if room_bytes is None else int(max(0, room_bytes)))


def tell(setting: str, current: Optional[float], freed_bytes: Optional[int],
         device: Optional[int], room_bytes: Optional[int] = None,
         previous: Optional[Headroom] = None) -> Optional[Headroom]:
    """The headroom ``freed_bytes`` (and ``room_bytes``) give ``setting``: logged
    at the first, and again where a later rollout lowers it (the adapter that asks:
    verl's worker, TRL's callback); ``previous`` otherwise, None when unknown."""
    headroom = vllm_headroom(setting, current, freed_bytes, gpu_total_bytes(device),
                             room_bytes=room_bytes)
    if headroom is None:
        return previous
    if previous is None:
        logger.info("amem_callbacks: headroom: %s", headroom.line())
        return headroom
    if headroom.suggested < previous.suggested:
        logger.info("amem_callbacks: headroom, revised at a later rollout: %s", headroom.line())
        return headroom
    return previous


def freed_on_this_gpu(report) -> Optional[int]:
    """The bytes this rank's begin freed for this rank's own engine: NCCL's
    account of this rank's groups. On a GPU shared by several ranks each has
    its own vLLM engine and its own share, so each may take only what its own
    suspends freed (the device-wide reading would hand every rank all of it)."""
    if report is None or report.skipped:
        return None
    return report.nccl_bytes


def gpu_total_bytes(device: Optional[int] = None) -> Optional[int]:
    """The device's total memory where torch is imported and sees CUDA, else None."""
    if not is_cuda_available():
        return None
    torch = loaded_torch()
    return torch.cuda.mem_get_info(device if device is not None else
                                   torch.cuda.current_device())[1]
