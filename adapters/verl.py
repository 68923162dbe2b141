"""verl 0.9.1: ``actor_rollout_ref.rollout.custom.amem: {enable: true}``; the training workers'
and the driver's hooks, installed when verl imports this module (docs/verl.md)."""

from __future__ import annotations

import asyncio
import collections
import inspect
import threading
from typing import Optional

from amem_callbacks import host_backup
from amem_callbacks.availability import is_cuda_available
from amem_callbacks.errors import AdapterError
from amem_callbacks.groups import register_roles
from amem_callbacks.log import logger, warn_once
from amem_callbacks.patching import ImportHooks, Patches, wrapper
from amem_callbacks.report import merge_rank_metrics
from amem_callbacks.session import RolloutSession, SessionViews

from ._verl_config import CONFIG_KEY, AmemSettings, read_settings

__all__ = ["AmemSettings", "WorkerSession", "current_session", "install", "make_policy",
           "merge_rank_metrics", "read_settings"]

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
    e.g. tests put a fake NCCL behind it). Runs on verl's thread for the worker
    method, whose CUDA device is verl's; the transitions run on other threads:
    ``device=`` says which."""
    import torch  # verl's worker has torch loaded; the adapter module does not import it

    from amem_callbacks import OffloadPolicy  # the package's light top level, at use

    device = torch.cuda.current_device() if is_cuda_available() else None
    return OffloadPolicy(settings.options(device=device))


# --- the training-worker side ---------------------------------------------
# Where a suspend comes (amem/verl/<seam> counts each), and the call it is made in.
BEFORE_KV_CACHE = "suspends_before_kv_cache"    # update_weights, right before the KV wake-up
WITHOUT_KV_CACHE = "suspends_without_kv_cache"  # update_weights' end, free_cache_engine off
BEFORE_LAUNCH = "suspends_before_launch"        # the driver launches the rollout servers
SEAM_CALLS = {BEFORE_KV_CACHE: "update_weights", WITHOUT_KV_CACHE: "update_weights",
              BEFORE_LAUNCH: "rollout server launch"}


class WorkerSession(SessionViews):
    """The rollout phase of one training-worker process. ``suspend``, ``rollout_ended`` and
    ``resume`` are collective: the driver sends each worker call to every rank, and the
    wrappers call them at the same point of it. The policy overlaps: resumes run in the
    background from the end of rollout until the next training call waits for them."""

    def __init__(self, settings: AmemSettings, policy, gpu_memory_utilization=None):
        self.settings = settings
        self.session = RolloutSession(policy)
        self.gpu_memory_utilization = gpu_memory_utilization  # the rollout's vLLM/SGLang share
        self._lock = threading.Lock()
        # Where each suspend and end happened, for verl's tracker: a run's log then shows
        # that they came at the seams meant (docs/verl.md), not only that they came.
        self.seams: collections.Counter = collections.Counter()

    @property
    def reports(self) -> dict:
        """"begin"/"end" -> the last finished report of each."""
        return {kind: r for kind, r in (("begin", self.last_begin), ("end", self.last_end)) if r}

    def suspend(self, seam: str = BEFORE_KV_CACHE) -> None:
        """Suspend the idle groups and return once they are free. Where memory is
        taken next (``seam`` not ``WITHOUT_KV_CACHE``), wait until it is free on every
        rank, not only here: a replica's leader wakes the KV cache on all of the
        replica's GPUs, and with ``keep: [world]`` no suspended group need contain
        its peers."""
        with self._lock:
            self.seams[seam] += 1
            report = self.session.start(SEAM_CALLS[seam], need_bytes=None)
            self.session.tell_headroom("actor_rollout_ref.rollout.gpu_memory_utilization",
                                       self.gpu_memory_utilization, report)
            if seam != WITHOUT_KV_CACHE:
                late = self.session.store_barrier("verl-suspended")  # rounds number the calls
                if late:
                    logger.warning("amem_callbacks: rank(s) %s had not freed their NCCL memory "
                                   "within %g s; the rollout's memory may be taken before it is "
                                   "free", late, self.policy.options.agree_timeout_s)

    def rollout_ended(self) -> bool:
        """The driver says rollout is over: start resuming in the background."""
        with self._lock:
            ended = self.session.stop("sleep_replicas (early)", guarded_until_settle=True) \
                is not None
            self.seams["ends_at_sleep_replicas"] += ended
            return ended

    def resume(self) -> None:
        """End the phase (unless done) and wait until every group is back: the next
        call may run collectives the guard cannot see (DTensor ``full_tensor``)."""
        with self._lock:
            ended = self.session.stop("next training call", guarded_until_settle=True)
            self.seams["ends_at_training_call"] += ended is not None
        self.session.settle()

    def metrics(self, prefix: str = "amem/") -> dict:
        """The session's figures and, beside them, how often each seam was taken
        (``amem/verl/...``)."""
        out = super().metrics(prefix)
        if out:
            out.update({f"{prefix}verl/{name}": n for name, n in sorted(self.seams.items())})
        return out


_session: Optional[WorkerSession] = None
_session_decided = False


def current_session() -> Optional[WorkerSession]:
    """This process's training-worker session, once its first weight update ran."""
    return _session


def _session_for(worker) -> Optional[WorkerSession]:
    """The session, decided at the worker's first call after init_model (the servers'
    launch, or the first weight update) from its config: the groups exist by then, to
    check ``keep`` against."""
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
    """init_model: a bad ``amem`` block fails before any model is built; with amem on, the
    host-backup hook goes in now, before the model's communicators start NCCL's runtime."""
    settings = read_settings(self.config.rollout.get("custom"))
    if settings.enable:
        host_backup.prepare(settings.options(keep=()))


async def _suspend_at_kv_cache(method, self, *args, **kwargs):
    """update_weights: resume first, then suspend just before the KV cache returns."""
    session = _session_for(self)
    if session is None:
        return await method(self, *args, **kwargs)
    await asyncio.to_thread(session.resume)
    mode = inspect.signature(method).bind(self, *args, **kwargs).arguments.get("mode", "auto")
    backend = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
    if not _shares_gpus(self, backend):
        warn_once(f"backend {backend}", "amem_callbacks: checkpoint_engine backend %r: "
                   "trainer and rollout do not share GPUs, nothing is suspended", backend)
        return await method(self, *args, **kwargs)
    fired = []

    async def resume(inner, *r_args, **r_kwargs):
        tags = r_kwargs.get("tags", r_args[0] if r_args else ())
        if "kv_cache" in tags and not fired:
            fired.append(True)
            await asyncio.to_thread(session.suspend)
        return await inner(*r_args, **r_kwargs)

    for_this_call = Patches()  # on this rollout object, undone when the call returns
    for_this_call.wrap(self.rollout, "resume", resume, required=True)
    try:
        result = await method(self, *args, **kwargs)
    finally:
        for_this_call.undo()
    if not fired:  # free_cache_engine off: no KV cache comes back, suspend now
        await asyncio.to_thread(session.suspend, WITHOUT_KV_CACHE)
    return result


def _shares_gpus(worker, backend: Optional[str] = None) -> bool:
    """Trainer and rollout on the same GPUs: the naive checkpoint engine (``backend``, or
    the worker's configured one) and a rollout in this worker."""
    backend = backend or worker.config.rollout.checkpoint_engine.backend
    return backend == "naive" and getattr(worker, "rollout", None) is not None


# The three methods the driver calls on the actor worker group (added to it).
def amem_rollout_launching(self):
    """The driver launches the rollout servers next: their engines allocate their
    weights and KV cache at once, beside this worker's live groups; suspend first.
    The driver's sleep_replicas that follows the launch ends the phase."""
    session = _session_for(self)
    if session is None or not _shares_gpus(self):
        return False
    session.suspend(BEFORE_LAUNCH)
    return True


def amem_rollout_ended(self):
    """Rollout is over (driver): start resuming in the background."""
    return _session.rollout_ended() if _session is not None else False


def amem_metrics(self):
    """This rank's ``amem/...`` figures (empty when amem is off)."""
    return _session.metrics() if _session is not None else {}


# --- the driver side: the end of rollout, every rank's figures for verl's tracker ---
class _Driver:
    """What the driver process knows: whether a config enabled amem, and whom to ask."""

    def __init__(self):
        self.enabled = False
        self.worker_groups: list = []

    def rollout_ended(self, worker_group) -> None:
        self._call(worker_group, "amem_rollout_ended", "groups resume at the next training "
                   "call instead")

    def rollout_launching(self, worker_group) -> None:
        self._call(worker_group, "amem_rollout_launching", "the servers' first KV cache is "
                   "allocated beside the live NCCL groups")

    def _call(self, worker_group, name: str, otherwise: str) -> None:
        method = getattr(worker_group, name, None)
        if method is None:
            warn_once(f"no {name}", "amem_callbacks: the actor worker group has no %s (the "
                      "hooks were installed after it was built): %s", name, otherwise)
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


async def _signal_after_sleep(method, self, *args, **kwargs):
    result = await method(self, *args, **kwargs)
    if _driver.enabled:
        await asyncio.to_thread(_driver.rollout_ended, self.actor_wg)
    return result


async def _suspend_before_launch(method, self, *args, **kwargs):
    """LLMServerManager._initialize_llm_servers: a hybrid launch (the training workers'
    GPUs) allocates every engine's KV cache; the training groups are suspended first."""
    if _driver.enabled and getattr(self, "worker_group", None) is not None:
        await asyncio.to_thread(_driver.rollout_launching, self.worker_group)
    return await method(self, *args, **kwargs)


def _log_with_metrics(method, self, data, step, *args, **kwargs):
    extra = _driver.metrics() if _driver.enabled else {}
    return method(self, {**data, **extra} if extra else data, step, *args, **kwargs)


def _after_config(result, config, *args, **kwargs) -> None:
    """A RolloutConfig was built (driver side): with amem on, the driver signals the
    end of rollout and collects metrics."""
    if read_settings(config.custom).enable:
        _driver.enabled = True
        _raise_hook_errors()


# --- installing the wrappers ----------------------------------------------
_hook_errors: list = []


def _raise_hook_errors() -> None:
    """amem is on: a verl class we could not wrap must stop the job, not be ignored."""
    if _hook_errors:
        raise AdapterError(f"{CONFIG_KEY}.enable is true but verl could not be hooked "
                           f"(amem_callbacks supports verl 0.9.1): " + "; ".join(_hook_errors))


def _patch_engine_workers(module) -> None:
    # optional framework: runs in verl's import hook
    from verl.single_controller.base.decorator import Dispatch, register

    patches = _hooks.patches
    for class_name, names in RESUME_BEFORE.items():
        cls = getattr(module, class_name)
        for name in names:
            patches.wrap(cls, name, before=_resume_first, required=True)
    worker = module.ActorRolloutRefWorker
    patches.wrap(worker, "update_weights", _suspend_at_kv_cache, required=True)
    patches.wrap(worker, "init_model", before=_validate_first, required=True)
    for method in (amem_rollout_launching, amem_rollout_ended, amem_metrics):
        method = register(dispatch_mode=Dispatch.ONE_TO_ALL)(method)
        # named where it now lives, so that cloudpickle sends it by reference: by value,
        # a copy would read this module's _session as it was in the driver (None)
        method.__module__, method.__qualname__ = (
            worker.__module__, f"{worker.__qualname__}.{method.__name__}")
        patches.add(worker, method.__name__, method)


def _patch_checkpoint_engine(module) -> None:
    from verl.utils.ray_utils import auto_await  # optional framework: runs in verl's import hook

    def replace(method):
        # sleep_replicas is auto_await(async fn), and auto_await looks at its caller's
        # frame: wrap the coroutine function inside it and apply auto_await again.
        inner = inspect.unwrap(method, stop=inspect.iscoroutinefunction)
        if not inspect.iscoroutinefunction(inner):
            raise AdapterError("CheckpointEngineManager.sleep_replicas is not a coroutine function")
        return auto_await(wrapper(inner, _signal_after_sleep))

    _hooks.patches.wrap(module.CheckpointEngineManager, "sleep_replicas", replace=replace,
                        required=True)


def _hook_failed(name: str, exc: Exception) -> None:
    """Never break verl's own import; enable=true reports it (_raise_hook_errors)."""
    _hook_errors.append(f"{name}: {exc!r}")
    logger.error("amem_callbacks: could not hook %s (this verl is not 0.9.1?): %r", name, exc)


_hooks = ImportHooks({
    "verl.workers.engine_workers": _patch_engine_workers,
    "verl.checkpoint_engine.base": _patch_checkpoint_engine,
    "verl.workers.rollout.llm_server": lambda module: _hooks.patches.wrap(
        module.LLMServerManager, "_initialize_llm_servers", _suspend_before_launch,
        required=True),
    "verl.utils.tracking": lambda module: _hooks.patches.wrap(
        module.Tracking, "log", _log_with_metrics, required=True),
    "verl.workers.config.rollout": lambda module: _hooks.patches.wrap(
        module.RolloutConfig, "__post_init__", after=_after_config, required=True),
}, on_error=_hook_failed)


def install() -> None:
    """Wrap the verl classes now if loaded, else as soon as verl loads them. Runs
    when this module is imported (entry point or ``external_lib``); again: no-op."""
    _hooks.install()


install()
