"""Where a Megatron rollout begins and ends, and where its engine steps (megatron-core
0.19.2, Megatron-LM core_r0.19.0; the seams: docs/megatron.md). Whichever seam comes first
acts; a second begin or end does nothing. Modules are patched when first imported:
installing imports neither torch nor Megatron."""

from __future__ import annotations

import time
from typing import Callable

from amem_callbacks.log import logger
from amem_callbacks.patching import ImportHooks

from . import param_sync
from .args import settings_from_args
from .offload import RolloutOffload, megatron_args
from .regrow import is_regrowing

LOOP_FUNCTION = "get_environment_rollouts"
_controller = None


# --- the controller the hooks report to -----------------------------------
def set_controller(controller) -> None:
    global _controller
    _controller = controller


def current_controller():
    """The installed controller; else one built from Megatron's parsed args
    (when ``add_args`` put the flags there); None while offloading is off."""
    global _controller
    if _controller is None:
        args = megatron_args()
        if args is not None and hasattr(args, "rl_amem_offload_during_rollout"):
            _controller = RolloutOffload(settings_from_args(args))
    return _controller if _controller is not None and _controller.enabled else None


# --- the seams ---------------------------------------------------------------
def engine_suspended(engine) -> bool:
    """The engine's own test in ``resume``: ``state`` (0.17+) or ``is_suspended``."""
    state = getattr(engine, "state", None)
    name = getattr(state, "name", None)
    if name is not None:
        return name in ("SUSPENDED", "SUSPENDING")
    return bool(getattr(engine, "is_suspended", False))


def _call(method: str, *args, **kwargs):
    controller = current_controller()
    return getattr(controller, method)(*args, **kwargs) if controller is not None else None


def patch_engine(cls) -> bool:
    """Wrap ``cls.resume``/``cls.suspend`` (a DynamicInferenceEngine class), and
    ``cls.async_step``, the boundary between two engine steps."""
    where = cls.__name__

    def resume(original, self, *args, **kwargs):
        # a real wake-up, not the coordinator's 20 ms poll nor a mid-rollout regrow
        if not engine_suspended(self) or is_regrowing(self):
            return original(self, *args, **kwargs)
        _call("engine_resuming", self, via=f"{where}.resume")
        began = time.monotonic()
        out = original(self, *args, **kwargs)
        _call("engine_resumed", self, time.monotonic() - began)
        return out

    def suspend(original, self, *args, **kwargs):
        was_suspended = engine_suspended(self)
        out = original(self, *args, **kwargs)
        if not was_suspended and not is_regrowing(self):
            _call("rollout_end", self, via=f"{where}.suspend")
        return out

    def step(original, self, *args, **kwargs):
        controller = current_controller()
        if controller is None:
            return original(self, *args, **kwargs)
        controller.engine_step(self, via=f"{where}.async_step")
        return _stepped(controller, self, original(self, *args, **kwargs))

    patches = _hooks.patches
    ok = (patches.wrap(cls, "resume", resume) | patches.wrap(cls, "suspend", suspend)
          | patches.wrap(cls, "async_step", step))
    if "resume" not in cls.__dict__ or "suspend" not in cls.__dict__:
        logger.warning("amem_callbacks: %s has no resume()/suspend(); this Megatron version "
                       "is not supported by the rollout hooks", where)
        return False
    return ok


async def _stepped(controller, engine, step):
    result = await step
    controller.engine_stepped(engine, result)
    return result


def patch_interface(cls) -> bool:
    """Wrap ``cls.resume``/``cls.suspend`` (Megatron-LM's RL inference interface;
    sync or async, the wrappers follow)."""
    where = cls.__name__
    engine_of = lambda self: getattr(self, "_inference_engine", None)  # noqa: E731
    return (_hooks.patches.wrap(cls, "resume", before=lambda self, *a, **k: _call(
                "rollout_begin", engine_of(self), via=f"{where}.resume"))
            | _hooks.patches.wrap(cls, "suspend", after=lambda result, self, *a, **k: _call(
                "rollout_end", engine_of(self), via=f"{where}.suspend")))


def patch_loop(module) -> bool:
    """Wrap ``get_environment_rollouts`` of Megatron-LM's RL loop."""
    def around(original, *args, **kwargs):
        controller = current_controller()
        if controller is None:
            return original(*args, **kwargs)
        named = dict(zip(("model", "inference_model", "optimizer"), args), **kwargs)
        # The launch (first rollout) broadcasts on groups a begin would suspend, and a
        # separate inference model is refitted over training groups first: begin
        # later there (MegatronLocal.resume).
        interface = getattr(module, "_INFERENCE_INTERFACE", None)
        engine = None if named.get("inference_model") is not None else getattr(
            interface, "_inference_engine", None)
        try:
            controller.before_rollouts(engine, named.get("model"), named.get("optimizer"))
            return original(*args, **kwargs)
        finally:
            controller.after_rollouts()

    if not hasattr(module, LOOP_FUNCTION):
        logger.warning("amem_callbacks: %s has no %s: the begin waits for the engine's "
                       "resume and the deferred parameter gathers are finished there",
                       module.__name__, LOOP_FUNCTION)
    return _hooks.patches.wrap(module, LOOP_FUNCTION, around)


def _patch_class(class_name: str, patch: Callable) -> Callable:
    def action(module):
        cls = getattr(module, class_name, None)
        if cls is None:
            logger.warning("amem_callbacks: %s has no %s; rollout hooks not installed there",
                           module.__name__, class_name)
            return
        patch(cls)
    return action


_hooks = ImportHooks({
    "megatron.core.inference.engines.dynamic_engine":
        _patch_class("DynamicInferenceEngine", patch_engine),
    "megatron.rl.inference.megatron": _patch_class("MegatronLocal", patch_interface),
    "megatron.rl.rl_utils": patch_loop,
    param_sync.DDP_MODULE: _patch_class(
        param_sync.DDP_CLASS, lambda cls: param_sync.track(cls, _hooks.patches)),
})


def install_hooks() -> None:
    """Patch the engine, the RL interface, the RL loop and DDP now or when they are
    imported (idempotent)."""
    _hooks.install()


def remove_hooks() -> None:
    """Undo every patch and forget the controller (for tests)."""
    _hooks.remove()
    set_controller(None)


__all__ = ["current_controller", "engine_suspended", "install_hooks", "megatron_args",
           "remove_hooks", "set_controller"]
