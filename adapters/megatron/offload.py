"""The per-process controller the rollout hooks call: a ``RolloutSession`` over Megatron's
groups, the deferred parameter gather, the KV-cache growth, the figures (docs/megatron.md)."""

from __future__ import annotations

import collections
import sys
import time
from typing import Optional

from amem_callbacks import OffloadPolicy, host_backup
from amem_callbacks.availability import is_distributed_initialized
from amem_callbacks.log import logger
from amem_callbacks.memory import empty_cache
from amem_callbacks.report import write_scalars
from amem_callbacks.session import RolloutSession, SessionViews

from . import param_sync, roles
from .args import Settings
from .growth import KvCacheGrowth
from .meter import tokens_of

#: Megatron-LM broadcasts the rollouts on the default group right after the engine suspends.
RESUME_FIRST = ("world",)
#: The begin is agreed where the rollout starts, but each rank's suspends wait until its
#: engine's first step with tokens has ended, at most this long: while NCCL pins a
#: suspend's host backup the process's GPU work stands still, so the engine's first
#: steps would wait behind the suspends (docs/evidence.md). The bound is for an
#: engine that never steps (no request reached it): its peers' suspends wait for its own.
#: Where the last rollout begun at the same seam had suspends that took less than the
#: time from its begin to the engine's resume, they are not held: they end before the
#: engine needs the GPU, and the cache can take their memory at the resume (no regrow).
HOLD_UNTIL_FIRST_TOKEN_S = 5.0


class RolloutOffload(SessionViews):
    """Suspends the groups a Megatron rollout leaves idle, from its begin to its end; the
    policy is built at the first rollout, once ``parallel_state`` exists (which groups stay
    active depends on the engine: :func:`roles.classify`). ``backend``: a Backend instance
    instead of ``settings.backend`` (tests); ``writers``: ``(tensorboard, wandb)``, default
    Megatron's global writers; ``policy_options``: more OffloadOptions fields."""

    def __init__(self, settings: Settings, *, backend=None, writers=None,
                 policy_options: Optional[dict] = None):
        extra = dict(policy_options or {})
        if backend is not None:
            extra["backend"] = backend
        self.options = settings.options(resume_first=RESUME_FIRST, **extra)  # bad input fails now
        if settings.enabled:  # before Megatron's first communicator (the launcher installs us)
            host_backup.prepare(self.options)
        self.settings = settings
        self._writers = writers
        self.session: Optional[RolloutSession] = None
        self.rollout_groups = None  # roles.RolloutGroups, at the first rollout
        self.kv_reports: collections.deque = collections.deque(maxlen=16)
        self._growth = KvCacheGrowth(int(settings.kv_margin_gb * 2**30), self._exchange) \
            if settings.grow_kv_cache else None
        self._hooks_off: list = []  # model chunks whose parameter-gather hooks are off
        self._warned = False
        # [seam, report, seconds from it to the engine's resume (None: not yet)] of the
        # latest begin: the next begin at that seam reads it
        self._last_begin: Optional[list] = None
        self._fits_before_resume: dict = {}  # seam -> its last suspends ended before the resume

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    @property
    def growth(self) -> Optional[KvCacheGrowth]:
        """The KV cache growth (``--rl-amem-grow-kv-cache``), None when it is off: read
        its ``waiting``, ``decisions`` and ``measured`` figures for logs and checks; the
        controller alone drives it."""
        return self._growth

    @property
    def reports(self) -> list:
        """(via, report) pairs, most recent last; bounded."""
        return list(self.session.history) if self.session is not None else []

    # --- the seams -----------------------------------------------------------
    def before_rollouts(self, engine, model=None, optimizer=None) -> None:
        """Megatron-LM asks for rollouts (``get_environment_rollouts``): finish the
        deferred parameter gather with the optimizer at hand, then, with a
        launched in-place engine, begin at once (overlapped)."""
        if self.enabled and not self.active:
            self._hooks_off += param_sync.finish_before_suspend(model, optimizer)
        if engine is not None:
            self.rollout_begin(engine, via="get_environment_rollouts")

    def after_rollouts(self) -> None:
        """The rollouts are back (or failed): the pre-hooks must be on again, or
        training would run on parameters nobody gathered."""
        param_sync.restore(self._hooks_off)
        self._hooks_off = []

    def rollout_begin(self, engine=None, via: str = ""):
        """Collective over all ranks: start suspending the idle groups. Returns the
        report, or None when a rollout is already active or nothing can be done yet."""
        if not self.enabled or self.active:
            return None
        if not is_distributed_initialized() or not roles.is_initialized():
            if not self._warned:
                self._warned = True
                logger.warning("amem_callbacks: rollout began (%s) before torch.distributed "
                               "and Megatron's parallel_state were initialized; nothing "
                               "offloaded", via)
            return None
        # A loop other than Megatron-LM's: finish the gathers of every tracked chunk
        # (without the optimizer; chunks that need it keep their hooks, and the guard
        # resumes their group if a hook gathers).
        self._hooks_off += param_sync.finish_before_suspend(None, None)
        if self.session is None:
            self.session = RolloutSession(self._build_policy(engine))
        hold_s = self._hold_s(via)
        report = self._logged(self.session.start(via, need_bytes=0, hold_s=hold_s), via)
        if report is not None:
            self._last_begin = [via, report, None]
        if self._growth is not None and self.active:
            self._growth.rollout_started(engine)
        return report

    def engine_resuming(self, engine, via: str = ""):
        """The engine is about to re-allocate its KV cache: begin if not yet; with
        growth on, decide and size this rollout's cache, without waiting for the
        suspends (it grows between steps once they are over: :meth:`engine_step`)."""
        # How long the suspends had until the engine's work: since the begin at the loop's
        # seam; none when begun here (so that seam always holds).
        begun_here = self.rollout_begin(engine, via=via) is not None
        if self._last_begin is not None and self._last_begin[2] is None:
            self._last_begin[2] = 0.0 if begun_here else \
                time.monotonic() - self._last_begin[1].started
        if self._growth is None or not self.active:
            return None
        report = self._growth.before_resume(engine, self.session)
        decision = self._growth.decision  # None where none was made (a peer missing)
        return self._kv_logged(report, via, decision.as_dict() if decision else {})

    def engine_resumed(self, engine, seconds: float) -> None:
        """The engine's own resume took ``seconds`` (re-allocation and graph capture)."""
        if self._growth is not None and self.active:
            self._growth.resumed(seconds)

    def engine_step(self, engine, via: str = ""):
        """Between two engine steps: with growth on, grow the cache once the suspends
        of every rank of this replica are over."""
        if self._growth is None or not self.active:
            return None
        report = self._growth.before_step(engine, self.session)
        return self._kv_logged(report, via) if report is not None else None

    def engine_stepped(self, engine, result, via: str = "") -> None:
        """A step has ended: the first with tokens lets this rank's suspends start."""
        if self.active and tokens_of(result) > 0:  # a no-op once they started
            self.session.start_suspends(via or "the engine's first step with tokens")
        if self._growth is not None and self.active:
            self._growth.after_step(engine, result)

    def rollout_end(self, engine=None, via: str = ""):
        """Collective over all ranks: resume what ``rollout_begin`` suspended."""
        if not self.active:
            return None
        if self._growth is not None:
            grown = self._growth.grown
            figures = self._growth.at_end(engine, self.session)
            if figures is not None:
                write_metrics(figures.as_dict(), self._writers)
            if grown:
                empty_cache()  # the grown cache's blocks, for NCCL's resume
        report = self.session.stop(via, guarded_until_settle=_guard_sees_training())
        self.after_rollouts()
        return self._logged(report, via)

    def _hold_s(self, via: str) -> float:
        """This begin's hold: none without overlap, or where the last begin at this seam
        had suspends (their own duration, held time left out) shorter than its time to
        the engine's resume."""
        if self._last_begin is not None:
            last_via, report, gap = self._last_begin
            if gap is not None and not report.pending and not report.skipped and report.planned:
                self._fits_before_resume[last_via] = \
                    report.wall_seconds - report.held_seconds < gap
        if not self.options.overlap or self._fits_before_resume.get(via, False):
            return 0.0
        return HOLD_UNTIL_FIRST_TOKEN_S

    # --- set-up at the first rollout ----------------------------------------------
    def _build_policy(self, engine) -> OffloadPolicy:
        groups = roles.classify(engine, keep=self.settings.keep)
        groups.name_groups()
        self.rollout_groups = groups
        logger.info("amem_callbacks: Megatron rollout offload, %s", groups.describe())
        return OffloadPolicy(self.options.replace(
            keep={"rollout": groups.kept_names}, groups=groups.groups))

    def _exchange(self, name: str, value: str, ranks) -> tuple:
        return self.session.store_exchange(name, value, ranks)

    def _kv_logged(self, report, via: str, extra: Optional[dict] = None):
        self.kv_reports.append(report)
        logger.info("amem_callbacks: rollout at %s: %s", via, report.summary())
        write_metrics({**report.as_dict(), **(extra or {})}, self._writers)
        return report

    def _logged(self, report, via: str):
        if report is not None:
            logger.info("amem_callbacks: rollout %s at %s: %s", report.kind, via, report.summary())
            write_metrics(self.metrics(), self._writers)
        return report


def _guard_sees_training() -> bool:
    """Whether every collective Megatron runs after the rollout is a ProcessGroup
    method call (the guard holds it back until its group is back)."""
    args = megatron_args()
    if args is None:
        return True
    blind = {"--use-megatron-fsdp": getattr(args, "use_megatron_fsdp", False),
             "--nccl-ub": getattr(args, "nccl_ub", False),
             "training CUDA graphs": getattr(args, "rl_training_cuda_graphs", False)
             or getattr(args, "cuda_graph_impl", "none") == "transformer_engine"
             or getattr(args, "external_cuda_graph", False)}
    return not any(blind.values())


def _global(name: str):
    """A global of Megatron-LM's ``global_vars`` (None when absent), without importing it."""
    return getattr(sys.modules.get("megatron.training.global_vars"), name, None)


def megatron_args():
    """Megatron-LM's global args."""
    return _global("_GLOBAL_ARGS")


def megatron_writers() -> tuple:
    """Megatron-LM's ``(tensorboard, wandb)`` writers; each None when absent."""
    return _global("_GLOBAL_TENSORBOARD_WRITER"), _global("_GLOBAL_WANDB_WRITER")


def write_metrics(metrics: dict, writers=None, step: Optional[int] = None) -> None:
    """Send ``amem/...`` figures to tensorboard and wandb, the way Megatron logs
    (its writers exist on one rank only; elsewhere nothing is written)."""
    tensorboard, wandb = writers if writers is not None else megatron_writers()
    if tensorboard is not None or wandb is not None:
        if step is None:  # Megatron-LM's iteration
            found = (getattr(megatron_args(), n, None) for n in ("curr_iteration", "iteration"))
            step = next((value for value in found if isinstance(value, int)), 0)
        write_scalars(metrics, tensorboard, wandb, step)
