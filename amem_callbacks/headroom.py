"""What the freed memory is worth to a vLLM rollout: the setting that uses it.

vLLM sizes its KV cache once, at start-up, from ``gpu_memory_utilization``
(a share of the GPU's total memory, checked against the memory free then),
and its sleep/wake-up keeps that size. So the package cannot grow a vLLM
cache by itself: vLLM starts before the first rollout, when every NCCL
communicator is still allocated, and an automatic raise would have to
restart the engine. What it can do is tell the user, from the first begin,
how far the setting can go with the communicators suspended during rollout:
the GPU's total memory is known, and so are the bytes the begin freed on it.
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

    def line(self) -> str:
        if self.suggested <= self.current:
            return (f"the suspended NCCL memory ({self.freed_bytes / 2**30:.2f} GiB on this GPU) "
                    f"is too small to raise {self.setting} from {self.current:g} "
                    f"(margin {self.margin_bytes / 2**30:.2f} GiB)")
        return (f"{self.freed_bytes / 2**30:.2f} GiB of NCCL memory is free on this GPU during "
                f"rollout: you can raise {self.setting} from {self.current:g} to "
                f"{self.suggested:g} (of {self.total_bytes / 2**30:.1f} GiB, "
                f"{self.margin_bytes / 2**30:.2f} GiB margin)")

    def as_dict(self, prefix: str = "amem/") -> dict:
        p = prefix + "headroom/"
        return {p + "freed_bytes": self.freed_bytes, p + "gpu_memory_utilization": self.suggested,
                p + "gpu_memory_utilization_now": self.current}


#: the suggestion is rounded down to this step: vLLM takes any float, and 0.01 of
#: an H200 (1.4 GiB) is more than one DDP communicator frees
STEP = 1e-4


def vllm_headroom(setting: str, current: float, freed_bytes: int, total_bytes: int,
                  margin_bytes: int = DEFAULT_MARGIN_BYTES) -> Optional[Headroom]:
    """The utilisation ``current`` plus the freed share, rounded down to
    :data:`STEP`; None when a figure is missing."""
    if not total_bytes or current is None or freed_bytes is None:
        return None
    usable = max(0, freed_bytes - margin_bytes)
    suggested = round(math.floor((current + usable / total_bytes) / STEP) * STEP, 4)
    suggested = max(current, min(CEILING, suggested))
    return Headroom(setting, float(current), suggested, int(freed_bytes), int(total_bytes),
                    int(margin_bytes))


def tell(setting: str, current: Optional[float], report, device: Optional[int]):
    """The headroom a finished begin's ``report`` gives ``setting``, logged once by
    the adapter that asks (verl's worker, TRL's callback); None when unknown."""
    headroom = vllm_headroom(setting, current, freed_on_this_gpu(report), gpu_total_bytes(device))
    if headroom is not None:
        logger.info("amem_callbacks: headroom: %s", headroom.line())
    return headroom


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
