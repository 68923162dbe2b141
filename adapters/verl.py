"""verl 0.9.1: one config entry frees the idle NCCL memory of every training
worker while the rollout servers generate::

    actor_rollout_ref.rollout.custom.amem: {enable: true}   # + backend, keep, guard, learn_keep

verl imports this module in each process (the ``verl.plugins`` entry point, or
``actor_rollout_ref.model.external_lib``); importing it only registers import
hooks, and every wrapper passes straight through unless ``enable: true``.
Suspend comes right before ``update_weights`` wakes the KV cache, resume at the
worker's next training call or earlier, in the background, once the driver's
``sleep_replicas`` ends rollout: docs/verl.md has the seams and why.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Optional

from amem_callbacks.errors import AdapterError
from amem_callbacks.groups import register_roles
from amem_callbacks.patching import Patches, when_imported, wrapper
from amem_callbacks.session import RolloutSession

from ._verl_config import CONFIG_KEY, AmemSettings, read_settings
from ._verl_driver import _driver  # noqa: F401  (the driver's state, read by tests)
from ._verl_driver import (check_config_after, log_with_metrics, merge_rank_metrics,
                           signal_after_sleep, warn_once)

__all__ = ["AmemSettings", "WorkerSession", "current_session", "install", "make_policy",
           "merge_rank_metrics", "read_settings"]

logger = logging.getLogger("amem_callbacks")

METRIC_PREFIX = "amem/"

# The DeviceMesh dimension names of verl's FSDP engine (its groups' "mesh_<dim>"
# descriptions): keep lists may name them before the meshes exist.
register_roles(("fsdp", "ddp", "dp", "sp"))

# Training calls after which the worker needs its groups again.
RESUME_BEFORE = {
    "ActorRolloutRefWorker": ("compute_log_prob", "compute_ref_log_prob", "update_actor",
                              "save_checkpoint", "load_checkpoint"),
    "TrainingWorker": ("train_batch", "train_mini_batch", "infer_batch", "save_checkpoint",
                       "load_checkpoint"),
}


def make_policy(settings: AmemSettings):
    """Build the worker's OffloadPolicy (replace this function to customise it,
    e.g. tests put a fake NCCL behind it).

    Called on the thread verl runs the worker method on, whose current CUDA
    device is verl's; the transitions run on other threads: ``device=`` says which.
    """
    import torch

    from amem_callbacks import OffloadPolicy

    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return OffloadPolicy(settings.options(device=device))


# --- the training-worker side ---------------------------------------------
class WorkerSession:
    """The rollout phase of one training-worker process.

    ``suspend``, ``rollout_ended`` and ``resume`` are collective: the driver
    sends each worker call to every rank, and the wrappers call them at the
    same point of it. The policy overlaps: resumes run in the background from
    the end of rollout until the next training call waits for them.
    """

    def __init__(self, settings: AmemSettings, policy, gpu_memory_utilization=None):
        self.settings = settings
        self.session = RolloutSession(policy)
        self.gpu_memory_utilization = gpu_memory_utilization  # the rollout's vLLM/SGLang share
        self._lock = threading.Lock()

    @property
    def policy(self):
        return self.session.policy

    @property
    def headroom(self):
        return self.session.headroom

    @property
    def reports(self) -> dict:
        """"begin"/"end" -> the last finished report of each."""
        return {kind: r for kind in ("begin", "end") if (r := self.session.last(kind))}

    def suspend(self, kv_cache_next: bool = True) -> None:
        """Suspend the idle groups and return once they are free. With the KV cache
        next, wait until the memory is free on every rank, not only here: a
        replica's leader wakes the KV cache on all of the replica's GPUs, and with
        ``keep: [world]`` no suspended group need contain its peers."""
        with self._lock:
            report = self.session.start("update_weights", need_bytes=None)
            self.session.tell_headroom("actor_rollout_ref.rollout.gpu_memory_utilization",
                                       self.gpu_memory_utilization, report)
            if kv_cache_next:
                late = self.session.store_barrier("verl-suspended")  # rounds number the calls
                if late:
                    logger.warning("amem_callbacks: rank(s) %s had not freed their NCCL memory "
                                   "within %g s; the KV cache may come back before it is free",
                                   late, self.policy.agree_timeout_s)

    def rollout_ended(self) -> bool:
        """The driver says rollout is over: start resuming in the background."""
        with self._lock:
            return self.session.stop("sleep_replicas (early)", guarded_until_settle=True) \
                is not None

    def resume(self) -> None:
        """End the phase (unless done) and wait until every group is back: the next
        call may run collectives the guard cannot see (DTensor ``full_tensor``)."""
        with self._lock:
            self.session.stop("next training call", guarded_until_settle=True)
        self.session.settle()

    def metrics(self) -> dict:
        """Totals, the last finished begin and end and the headroom, as flat
        ``amem/...`` numbers."""
        return self.session.metrics(METRIC_PREFIX)


_session: Optional[WorkerSession] = None
_session_decided = False


def current_session() -> Optional[WorkerSession]:
    """This process's training-worker session, once its first weight update ran."""
    return _session


def _session_for(worker) -> Optional[WorkerSession]:
    """The session, decided at the worker's first weight update from its config.

    Built there rather than in init_model: the groups exist by then, so the
    names in ``keep`` can be checked against them.
    """
    global _session, _session_decided
    if not _session_decided:
        settings = read_settings(worker.config.rollout.get("custom"))
        if settings.enable and "actor" in worker.role and "rollout" in worker.role:
            _raise_hook_errors()
            _session = WorkerSession(settings, make_policy(settings),
                                     worker.config.rollout.get("gpu_memory_utilization"))
            logger.info("amem_callbacks: verl training worker suspends its idle NCCL groups "
                        "during rollout (%s)", settings)
        _session_decided = True
    return _session


def _resume_first(self, *args, **kwargs) -> None:
    if _session is not None:
        _session.resume()


def _validate_first(self, *args, **kwargs) -> None:
    """init_model: a bad ``amem`` block fails before any model is built."""
    read_settings(self.config.rollout.get("custom"))


async def _suspend_at_kv_cache(method, self, *args, **kwargs):
    """update_weights: resume first, then suspend just before the KV cache returns."""
    session = _session_for(self)
    if session is None:
        return await method(self, *args, **kwargs)
    await asyncio.to_thread(session.resume)
    mode = inspect.signature(method).bind(self, *args, **kwargs).arguments.get("mode", "auto")
    backend = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
    if backend != "naive" or getattr(self, "rollout", None) is None:
        warn_once(f"backend {backend}", "amem_callbacks: checkpoint_engine backend %r: "
                   "trainer and rollout do not share GPUs, nothing is suspended", backend)
        return await method(self, *args, **kwargs)
    rollout = self.rollout
    shadowed = rollout.__dict__.get("resume")
    inner = rollout.resume
    fired = []

    async def resume(*r_args, **r_kwargs):
        tags = r_kwargs.get("tags", r_args[0] if r_args else ())
        if "kv_cache" in tags and not fired:
            fired.append(True)
            await asyncio.to_thread(session.suspend)
        return await inner(*r_args, **r_kwargs)

    rollout.resume = resume
    try:
        result = await method(self, *args, **kwargs)
    finally:
        if shadowed is None:
            del rollout.resume
        else:
            rollout.resume = shadowed
    if not fired:  # free_cache_engine off: no KV cache comes back, suspend now
        await asyncio.to_thread(session.suspend, False)
    return result


def _worker_methods(register, dispatch) -> dict:
    """The two methods the driver calls on the actor worker group."""

    @register(dispatch_mode=dispatch.ONE_TO_ALL)
    def amem_rollout_ended(self):
        """Rollout is over (driver): start resuming in the background."""
        return _session.rollout_ended() if _session is not None else False

    @register(dispatch_mode=dispatch.ONE_TO_ALL)
    def amem_metrics(self):
        """This rank's ``amem/...`` figures (empty when amem is off)."""
        return _session.metrics() if _session is not None else {}

    return {"amem_rollout_ended": amem_rollout_ended, "amem_metrics": amem_metrics}


# --- installing the wrappers ----------------------------------------------
_hook_errors: list = []
_patches = Patches()


def _after_config(result, config, *args, **kwargs) -> None:
    if check_config_after(config):
        _raise_hook_errors()


def _raise_hook_errors() -> None:
    """amem is on: a verl class we could not wrap must stop the job, not be ignored."""
    if _hook_errors:
        raise AdapterError(f"{CONFIG_KEY}.enable is true but verl could not be hooked "
                           f"(amem_callbacks supports verl 0.9.1): " + "; ".join(_hook_errors))


def _patch_engine_workers(module) -> None:
    from verl.single_controller.base.decorator import Dispatch, register

    for class_name, names in RESUME_BEFORE.items():
        cls = getattr(module, class_name)
        for name in names:
            _patches.wrap(cls, name, before=_resume_first, required=True)
    worker = module.ActorRolloutRefWorker
    _patches.wrap(worker, "update_weights", _suspend_at_kv_cache, required=True)
    _patches.wrap(worker, "init_model", before=_validate_first, required=True)
    for name, method in _worker_methods(register, Dispatch).items():
        method.__qualname__ = f"{worker.__qualname__}.{name}"
        _patches.add(worker, name, method)


def _patch_checkpoint_engine(module) -> None:
    from verl.utils.ray_utils import auto_await

    def replace(method):
        # sleep_replicas is auto_await(async fn), and auto_await looks at its caller's
        # frame: wrap the coroutine function inside it and apply auto_await again.
        inner = inspect.unwrap(method, stop=inspect.iscoroutinefunction)
        if not inspect.iscoroutinefunction(inner):
            raise TypeError("CheckpointEngineManager.sleep_replicas is not a coroutine function")
        return auto_await(wrapper(inner, signal_after_sleep))

    _patches.wrap(module.CheckpointEngineManager, "sleep_replicas", replace=replace,
                  required=True)


def _patch_tracking(module) -> None:
    _patches.wrap(module.Tracking, "log", log_with_metrics, required=True)


def _patch_rollout_config(module) -> None:
    _patches.wrap(module.RolloutConfig, "__post_init__", after=_after_config,
                  required=True)


_installed = False

PATCHES = {
    "verl.workers.engine_workers": _patch_engine_workers,
    "verl.checkpoint_engine.base": _patch_checkpoint_engine,
    "verl.utils.tracking": _patch_tracking,
    "verl.workers.config.rollout": _patch_rollout_config,
}


def _apply(name: str, module) -> None:
    try:
        PATCHES[name](module)
    except Exception as exc:  # never break verl's own import; enable=true reports it
        _hook_errors.append(f"{name}: {exc!r}")
        logger.error("amem_callbacks: could not hook %s (this verl is not 0.9.1?): %r", name, exc)


def install() -> None:
    """Wrap the verl classes now if loaded, else as soon as verl loads them.

    Runs when this module is imported (by the entry point or ``external_lib``);
    calling it again does nothing.
    """
    global _installed
    if _installed:
        return
    _installed = True
    for name in PATCHES:
        when_imported(name, lambda module, name=name: _apply(name, module))


install()
