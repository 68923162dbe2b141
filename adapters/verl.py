"""verl 0.9.1: one config entry frees the idle NCCL memory of every training
worker while the rollout servers generate.

    actor_rollout_ref:
      rollout:
        custom:
          amem:
            enable: true   # optional: backend, keep, overlap, guard

verl imports this module in each of its processes, through the
``verl.plugins`` entry point this package declares or through
``actor_rollout_ref.model.external_lib=amem_callbacks.adapters.verl``.
Importing it only registers import hooks: the verl classes below are wrapped
when verl loads them, and every wrapper passes straight through unless the
block above says ``enable: true``.

Where the boundaries are (read from verl 0.9.1, colocated mode, where
``rollout.checkpoint_engine.backend`` is ``naive``). Rollout runs in separate
server processes; the training worker (``ActorRolloutRefWorker``, and a critic
``TrainingWorker`` in the same process) waits idle for its next call.

- Suspend: inside ``ActorRolloutRefWorker.update_weights``, after the weights
  went to the rollout engine (their generator gathers over the training
  groups, so those are active until then) and right before
  ``rollout.resume(tags=["kv_cache"])`` re-allocates the KV cache; at the end
  of ``update_weights`` when ``free_cache_engine`` is off. Every rank makes
  that call, as the driver dispatches ``update_weights`` to all of them.
- Resume: at the start of the worker's next training call (log-prob,
  ref log-prob, actor or critic update, critic values, checkpoint save or
  load, the next ``update_weights``), or earlier, in the background, when the
  driver's ``CheckpointEngineManager.sleep_replicas`` says rollout is over.

Each rank decides from its own state (is a phase active?), and the driver sends
every call to every rank, so all ranks make the same collective calls.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from ._after_import import when_imported

logger = logging.getLogger("amem_callbacks")

PHASE = "rollout"
CONFIG_KEY = "actor_rollout_ref.rollout.custom.amem"
METRIC_PREFIX = "amem/"
#: key -> (accepted types, how the message describes it)
OPTIONS = {
    "enable": ((bool,), "true or false"),
    "backend": ((str,), "'auto', 'nccl', 'amem' or 'noop'"),
    "keep": ((list, tuple), "a list of group names, e.g. [world]"),
    "overlap": ((bool,), "true or false"),
    "guard": ((str,), "'resume', 'strict' or 'off'"),
}
VALID_KEYS = ", ".join(f"{k} ({d})" for k, (_, d) in OPTIONS.items())

# Training calls after which the worker needs its groups again.
RESUME_BEFORE = {
    "ActorRolloutRefWorker": ("compute_log_prob", "compute_ref_log_prob", "update_actor",
                              "save_checkpoint", "load_checkpoint"),
    "TrainingWorker": ("train_batch", "train_mini_batch", "infer_batch", "save_checkpoint",
                       "load_checkpoint"),
}


# --- configuration --------------------------------------------------------
@dataclass(frozen=True)
class AmemSettings:
    """The ``amem`` block of ``rollout.custom``, validated."""

    enable: bool = False
    backend: str = "auto"
    keep: tuple = ()
    overlap: bool = False
    guard: str = "resume"


def read_settings(custom) -> AmemSettings:
    """The ``amem`` settings in ``rollout.custom``; off when there is no block.

    Group names in ``keep`` are checked later, where the groups exist, when
    the worker builds its policy.

    Args:
        custom: ``actor_rollout_ref.rollout.custom``: a dict, a DictConfig or None.

    Raises:
        ValueError: an unknown key, a wrong type or an unknown choice; the
            message lists the valid keys.

    Example:
        >>> read_settings({"amem": {"enable": True, "keep": ["world"]}}).keep
        ('world',)
    """
    custom = _plain(custom)
    if custom is None:
        return AmemSettings()
    if not isinstance(custom, Mapping):
        raise ValueError(f"actor_rollout_ref.rollout.custom must be a mapping, got {custom!r}")
    block = custom.get("amem")
    if block is None:
        return AmemSettings()
    if not isinstance(block, Mapping):
        raise ValueError(f"{CONFIG_KEY} must be a mapping such as {{enable: true}}, got "
                         f"{block!r}; valid keys: {VALID_KEYS}")
    unknown = sorted(str(k) for k in block if k not in OPTIONS)
    if unknown:
        raise ValueError(f"{CONFIG_KEY}: unknown key(s) {unknown}; valid keys: {VALID_KEYS}")
    for key, value in block.items():
        types, description = OPTIONS[key]
        wrong = not isinstance(value, types)
        if key == "keep" and not wrong:
            wrong = not all(isinstance(name, str) and name for name in value)
        if wrong:
            raise ValueError(f"{CONFIG_KEY}.{key} must be {description}, got {value!r}; "
                             f"valid keys: {VALID_KEYS}")
    settings = AmemSettings(**{k: tuple(v) if k == "keep" else v for k, v in block.items()})
    from amem_callbacks import OffloadPolicy

    try:  # the policy's own checks of the choices (it touches no GPU and no group)
        OffloadPolicy(backend=settings.backend, guard=settings.guard, overlap=settings.overlap)
    except ValueError as exc:
        raise ValueError(f"{CONFIG_KEY}: {exc}; valid keys: {VALID_KEYS}") from None
    return settings


def _plain(value):
    """A DictConfig/ListConfig as plain containers; anything else unchanged."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def make_policy(settings: AmemSettings):
    """Build the worker's OffloadPolicy (replace this function to customise it,
    e.g. tests put a fake NCCL behind it).

    Called on the thread verl runs the worker method on, so its current CUDA
    device is the one verl uses; the suspend itself later runs on a pool
    thread (``asyncio.to_thread``) that starts on GPU 0.
    """
    import torch

    from amem_callbacks import OffloadPolicy

    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return OffloadPolicy(backend=settings.backend, keep=list(settings.keep),
                         guard=settings.guard, overlap=settings.overlap, device=device)


# --- the training-worker side ---------------------------------------------
class WorkerSession:
    """The policy of one training-worker process and its rollout phase.

    ``suspend`` and ``resume`` are collective: the wrappers call them on every
    rank at the same point of the same worker call.
    """

    def __init__(self, settings: AmemSettings, policy):
        self.settings = settings
        self.policy = policy
        self.reports: dict = {}  # "begin"/"end" -> last report
        self._lock = threading.Lock()
        self._generation = 0  # counts begins, so a late early-resume cannot end a newer phase
        self._early: Optional[threading.Thread] = None
        self._early_error: Optional[BaseException] = None

    def suspend(self) -> None:
        """Collective: suspend the idle groups and wait until their memory is free
        on every rank, not only here: a replica's leader wakes the KV cache on
        all of the replica's GPUs, and with ``keep: [world]`` no suspended group
        need contain its peers, so nothing else would make it wait for them."""
        with self._lock:
            self._generation += 1
            self._remember(self.policy.begin(PHASE))
            # Even with overlap the memory must be free before the KV cache comes back.
            self.policy.wait()
            late = self.policy.store_barrier("verl-suspended")  # rounds number the calls
            if late:
                logger.warning("amem_callbacks: rank(s) %s had not freed their NCCL memory "
                               "within %g s; the KV cache may come back before it is free",
                               late, self.policy.agree_timeout_s)

    def rollout_ended(self) -> bool:
        """The driver says rollout is over: start resuming in the background."""
        with self._lock:
            if self.policy.active_phase is None or self._early is not None:
                return False
            self._early = threading.Thread(target=self._end_early, args=(self._generation,),
                                           name="amem-verl-resume", daemon=True)
            self._early.start()
            return True

    def _end_early(self, generation: int) -> None:
        try:
            with self._lock:
                if self._generation == generation and self.policy.active_phase is not None:
                    self._remember(self.policy.end(PHASE))
        except BaseException as exc:  # re-raised by the next resume(), on the caller's thread
            self._early_error = exc

    def resume(self) -> None:
        """Collective: end the phase (unless done) and wait until every group is
        back, even with overlap: the next call may run collectives the guard
        cannot see (DTensor ``full_tensor`` in the FSDP engine)."""
        with self._lock:
            early, self._early = self._early, None
        if early is not None:
            early.join()
            error, self._early_error = self._early_error, None
            if error is not None:
                raise error
        with self._lock:
            if self.policy.active_phase is not None:
                self._remember(self.policy.end(PHASE))
        self.policy.wait()

    def metrics(self) -> dict:
        """Totals plus the last finished begin and end, as flat ``amem/...`` numbers."""
        out = self.policy.counters.as_dict(METRIC_PREFIX)
        for report in list(self.reports.values()):
            if not report.pending:
                out.update(report.as_dict(METRIC_PREFIX))
        return out

    def _remember(self, report) -> None:
        if not report.skipped:
            self.reports[report.kind] = report


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
            _session = WorkerSession(settings, make_policy(settings))
            logger.info("amem_callbacks: verl training worker suspends its idle NCCL groups "
                        "during rollout (%s)", settings)
        _session_decided = True
    return _session


def _resume_first(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if _session is not None:
            _session.resume()
        return method(self, *args, **kwargs)

    return wrapper


def _validate_first(method: Callable) -> Callable:
    """init_model: a bad ``amem`` block fails before any model is built."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        read_settings(self.config.rollout.get("custom"))
        return method(self, *args, **kwargs)

    return wrapper


def _suspend_at_kv_cache(method: Callable) -> Callable:
    """update_weights: resume first, then suspend just before the KV cache returns."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        session = _session_for(self)
        if session is None:
            return await method(self, *args, **kwargs)
        await asyncio.to_thread(session.resume)
        mode = signature.bind(self, *args, **kwargs).arguments.get("mode", "auto")
        backend = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
        if backend != "naive" or getattr(self, "rollout", None) is None:
            _warn_once(f"backend {backend}", "amem_callbacks: checkpoint_engine backend %r: "
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
            await asyncio.to_thread(session.suspend)
        return result

    return wrapper


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


# --- the driver side ------------------------------------------------------
class _Driver:
    """What the driver process knows: whether a config enabled amem, and whom to ask."""

    def __init__(self):
        self.enabled = False
        self.worker_groups: list = []

    def rollout_ended(self, worker_group) -> None:
        method = getattr(worker_group, "amem_rollout_ended", None)
        if method is None:
            _warn_once("no method", "amem_callbacks: the actor worker group has no "
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
                _warn_once("metrics", "amem_callbacks: could not collect metrics: %s", exc)
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


def _signal_after_sleep(coroutine_fn: Callable) -> Callable:
    @functools.wraps(coroutine_fn)
    async def sleep_replicas(self, *args, **kwargs):
        result = await coroutine_fn(self, *args, **kwargs)
        if _driver.enabled:
            await asyncio.to_thread(_driver.rollout_ended, self.actor_wg)
        return result

    return sleep_replicas


def _log_with_metrics(method: Callable) -> Callable:
    @functools.wraps(method)
    def log(self, data, step, *args, **kwargs):
        extra = _driver.metrics() if _driver.enabled else {}
        return method(self, {**data, **extra} if extra else data, step, *args, **kwargs)

    return log


def _check_config_after(method: Callable) -> Callable:
    @functools.wraps(method)
    def __post_init__(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        if read_settings(self.custom).enable:
            _raise_hook_errors()
            _driver.enabled = True
        return result

    return __post_init__


# --- installing the wrappers ----------------------------------------------
_hook_errors: list = []
_warned: set = set()
_MARK = "__amem_callbacks_hook__"


def _raise_hook_errors() -> None:
    """amem is on: a verl class we could not wrap must stop the job, not be ignored."""
    if _hook_errors:
        raise RuntimeError(f"{CONFIG_KEY}.enable is true but verl could not be hooked "
                           f"(amem_callbacks supports verl 0.9.1): " + "; ".join(_hook_errors))


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _wrap(cls, name: str, make: Callable) -> None:
    original = cls.__dict__.get(name)
    if original is None:
        raise AttributeError(f"{cls.__name__}.{name} not found")
    if getattr(original, _MARK, False):
        return
    wrapper = make(original)
    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)


def _patch_engine_workers(module) -> None:
    from verl.single_controller.base.decorator import Dispatch, register

    for class_name, names in RESUME_BEFORE.items():
        cls = getattr(module, class_name)
        for name in names:
            _wrap(cls, name, _resume_first)
    worker = module.ActorRolloutRefWorker
    _wrap(worker, "update_weights", _suspend_at_kv_cache)
    _wrap(worker, "init_model", _validate_first)
    for name, method in _worker_methods(register, Dispatch).items():
        if name not in worker.__dict__:
            method.__qualname__ = f"{worker.__qualname__}.{name}"
            setattr(method, _MARK, True)
            setattr(worker, name, method)


def _patch_checkpoint_engine(module) -> None:
    from verl.utils.ray_utils import auto_await

    def make(method):
        # sleep_replicas is auto_await(async fn), and auto_await looks at its caller's
        # frame: wrap the coroutine function inside it and apply auto_await again.
        inner = inspect.unwrap(method, stop=inspect.iscoroutinefunction)
        if not inspect.iscoroutinefunction(inner):
            raise TypeError("CheckpointEngineManager.sleep_replicas is not a coroutine function")
        return auto_await(_signal_after_sleep(inner))

    _wrap(module.CheckpointEngineManager, "sleep_replicas", make)


def _patch_tracking(module) -> None:
    _wrap(module.Tracking, "log", _log_with_metrics)


def _patch_rollout_config(module) -> None:
    _wrap(module.RolloutConfig, "__post_init__", _check_config_after)


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
