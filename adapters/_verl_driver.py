"""verl's driver side: it says when rollout is over (``sleep_replicas``) and
collects every rank's ``amem/...`` figures for verl's tracker."""

from __future__ import annotations

import asyncio
import logging

from ._verl_config import read_settings

logger = logging.getLogger("amem_callbacks")
_warned: set = set()


def warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


class _Driver:
    """What the driver process knows: whether a config enabled amem, and whom to ask."""

    def __init__(self):
        self.enabled = False
        self.worker_groups: list = []

    def rollout_ended(self, worker_group) -> None:
        method = getattr(worker_group, "amem_rollout_ended", None)
        if method is None:
            warn_once("no method", "amem_callbacks: the actor worker group has no "
                       "amem_rollout_ended (the hooks were installed after it was built): "
                       "groups resume at the next training call instead")
            return
        if not any(wg is worker_group for wg in self.worker_groups):
            self.worker_groups.append(worker_group)
        method()

    def metrics(self) -> dict:
        out = {}
        for worker_group in self.worker_groups:
            try:
                out.update(merge_rank_metrics(worker_group.amem_metrics()))
            except Exception as exc:  # figures are advisory: never break the trainer's logging
                warn_once("metrics", "amem_callbacks: could not collect metrics: %s", exc)
        return out


_driver = _Driver()


def merge_rank_metrics(per_rank) -> dict:
    """One figure per key across ranks: the slowest rank for times, else the mean."""
    per_rank = [m for m in per_rank or [] if m]
    keys = sorted({k for m in per_rank for k in m})
    out = {}
    for key in keys:
        values = [float(m[key]) for m in per_rank if key in m]
        out[key] = max(values) if key.endswith("seconds") else sum(values) / len(values)
    return out


async def signal_after_sleep(method, self, *args, **kwargs):
    result = await method(self, *args, **kwargs)
    if _driver.enabled:
        await asyncio.to_thread(_driver.rollout_ended, self.actor_wg)
    return result


def log_with_metrics(method, self, data, step, *args, **kwargs):
    extra = _driver.metrics() if _driver.enabled else {}
    return method(self, {**data, **extra} if extra else data, step, *args, **kwargs)


def check_config_after(config) -> bool:
    """A RolloutConfig was built (driver side): is amem on? Then the driver signals
    the end of rollout and collects metrics."""
    if read_settings(config.custom).enable:
        _driver.enabled = True
        return True
    return False
