"""The per-process controller the rollout hooks call: a ``RolloutSession`` over
Megatron's groups, and its figures for Megatron's loggers."""

from __future__ import annotations

import logging
import sys
from typing import Optional

from amem_callbacks.session import RolloutSession

from . import roles
from .args import Settings

logger = logging.getLogger("amem_callbacks")


class RolloutOffload:
    """Suspends the groups a Megatron rollout leaves idle, from its begin to its end.

    The policy is built at the first rollout, when ``parallel_state`` exists:
    which groups stay active depends on the engine (see
    :func:`~amem_callbacks.adapters.megatron.roles.classify`). Both seams
    block: the engine allocates its KV cache right after the begin, and
    training runs DDP and optimizer collectives right after the end.

    Args:
        settings: the flags' values.
        backend: a Backend instance to use instead of ``settings.backend`` (tests).
        writers: ``(tensorboard_writer, wandb_writer)``; default: Megatron's
            global writers, looked up at each report (either may be None).
        policy_options: more ``OffloadPolicy`` keyword arguments.

    Example:
        >>> controller = RolloutOffload(Settings(enabled=True, keep=("dp",)))
        >>> controller.rollout_begin(engine)   # every rank
        >>> controller.rollout_end(engine)
    """

    def __init__(self, settings: Settings, *, backend=None, writers=None,
                 policy_options: Optional[dict] = None):
        options = dict(policy_options or {})
        if "overlap" in options:
            raise ValueError("Megatron: overlap has nothing to hide here (the engine allocates "
                             "its KV cache right after the begin, and training collectives "
                             "follow the end at once): leave it out")
        from amem_callbacks import OffloadPolicy

        OffloadPolicy(backend=backend or settings.backend, **options)  # bad options fail now
        self.settings = settings
        self._backend = backend
        self._writers = writers
        self._policy_options = options
        self._engine = None
        self._warned = False
        self.plan = None
        self.session = RolloutSession(self._make_policy)

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def policy(self):
        return self.session.policy

    @property
    def active(self) -> bool:
        return self.session.active

    @property
    def reports(self) -> list:
        """(via, report) pairs, most recent last; bounded."""
        return list(self.session.history)

    def rollout_begin(self, engine=None, via: str = ""):
        """Collective over all ranks: suspend the idle groups. Returns the report,
        or None when a rollout is already active or nothing can be done yet."""
        if not self.enabled or self.active:
            return None
        if not _distributed_ready() or not roles.is_initialized():
            if not self._warned:
                self._warned = True
                logger.warning("amem_callbacks: rollout began (%s) before torch.distributed "
                               "and Megatron's parallel_state were initialized; nothing "
                               "offloaded", via)
            return None
        self._engine = engine
        return self._logged(self.session.start(via, memory_needed_now=True), via)

    def rollout_end(self, engine=None, via: str = ""):
        """Collective over all ranks: resume what ``rollout_begin`` suspended."""
        return self._logged(self.session.stop(via), via)

    def _make_policy(self):
        from amem_callbacks import OffloadPolicy

        plan = roles.classify(self._engine, keep=self.settings.keep)
        roles.name_groups(plan)
        self.plan = plan
        logger.info("amem_callbacks: Megatron rollout offload, %s", plan.describe())
        return OffloadPolicy(
            backend=self._backend or self.settings.backend, keep={"rollout": plan.kept_names},
            groups=plan.groups, backend_options=self.settings.backend_options(),
            **{"learn_keep": self.settings.learn_keep, **self._policy_options})

    def _logged(self, report, via: str):
        if report is not None:
            logger.info("amem_callbacks: rollout %s at %s: %s", report.kind, via, report.summary())
            write_metrics(self.session.metrics(), self._writers)
        return report


def _distributed_ready() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def megatron_writers() -> tuple:
    """Megatron-LM's ``(tensorboard, wandb)`` writers; each None when absent."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None:
        return None, None
    return (getattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", None),
            getattr(global_vars, "_GLOBAL_WANDB_WRITER", None))


def megatron_iteration() -> Optional[int]:
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars else None
    for name in ("curr_iteration", "iteration"):
        value = getattr(args, name, None)
        if isinstance(value, int):
            return value
    return None


def write_metrics(metrics: dict, writers=None, step: Optional[int] = None) -> None:
    """Send ``amem/...`` figures to tensorboard and wandb, the way Megatron logs.

    Megatron creates its writers on one rank only; elsewhere both are None
    and nothing is written.
    """
    tensorboard, wandb = writers if writers is not None else megatron_writers()
    if tensorboard is None and wandb is None:
        return
    if step is None:
        step = megatron_iteration() or 0
    if tensorboard is not None:
        for name, value in metrics.items():
            tensorboard.add_scalar(name, value, step)
    if wandb is not None:
        wandb.log(metrics, step)
