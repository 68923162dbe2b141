"""Where a Megatron rollout begins and ends, hooked without editing Megatron.

Two seams; both are wrapped and the controller acts on whichever comes first
(a begin while a rollout is active, or an end while none is, is ignored):

* ``DynamicInferenceEngine.resume`` / ``.suspend`` (megatron-core): resume
  re-allocates the KV cache and suspend frees it. Megatron-LM's RL loop drives
  them from 0.17 on (its interface sends SUSPEND/RESUME to the engines). The
  wrapper acts only when the call really changes the engine's state: in the
  coordinator loop ``resume()`` is called every 20 ms and returns at once.
* ``megatron.rl.inference.megatron.MegatronLocal.resume`` / ``.suspend``
  (Megatron-LM's RL inference interface, called once per rollout on every
  rank after the warm-up collectives). At core_v0.16.1 it only pauses and
  unpauses the engines and never calls the engine's suspend/resume; from 0.17
  on the first rollout finds the freshly launched engine running, so the
  engine's resume is not called either.

Begin runs before the wrapped resume, so the KV cache it allocates can use the
freed memory; end runs after the wrapped suspend, once the KV cache is gone.
The modules are patched when they are first imported (a ``sys.meta_path``
finder), so installing the hooks imports neither torch nor Megatron.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading

from .._after_import import forget, when_imported

logger = logging.getLogger("amem_callbacks")

ENGINE_MODULE = "megatron.core.inference.engines.dynamic_engine"
ENGINE_CLASS = "DynamicInferenceEngine"
INTERFACE_MODULE = "megatron.rl.inference.megatron"
INTERFACE_CLASS = "MegatronLocal"

_lock = threading.Lock()
_controller = None
_installed = False
_patched = []  # (class, name, original) to undo


# --- the controller the hooks report to -----------------------------------
def set_controller(controller) -> None:
    global _controller
    _controller = controller


def current_controller():
    """The installed controller; else one built from Megatron's parsed args
    (when ``add_args`` put the flags there); None while offloading is off."""
    global _controller
    if _controller is None:
        args = _megatron_args()
        if args is None or not hasattr(args, "rl_amem_offload_during_rollout"):
            return None
        from .args import settings_from_args
        from .offload import RolloutOffload

        _controller = RolloutOffload(settings_from_args(args))
    return _controller if _controller.enabled else None


def _megatron_args():
    """Megatron-LM's global args, without importing megatron.training."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars else None


# --- patching ----------------------------------------------------------------
def engine_suspended(engine) -> bool:
    """The engine's own test in ``resume``: ``state`` (0.17+) or ``is_suspended``."""
    state = getattr(engine, "state", None)
    name = getattr(state, "name", None)
    if name is not None:
        return name in ("SUSPENDED", "SUSPENDING")
    return bool(getattr(engine, "is_suspended", False))


def _replace(cls, name, make) -> bool:
    original = cls.__dict__.get(name)
    if original is None:
        return False
    if getattr(original, "__amem_original__", None) is None:
        wrapped = functools.wraps(original)(make(original))
        wrapped.__amem_original__ = original
        setattr(cls, name, wrapped)
        _patched.append((cls, name, original))
    return True


def patch_engine(cls) -> bool:
    """Wrap ``cls.resume``/``cls.suspend`` (a DynamicInferenceEngine class)."""
    where = f"{cls.__name__}"

    def make_resume(resume):
        def hooked(self, *args, **kwargs):
            controller = current_controller()
            if controller is not None and engine_suspended(self):
                controller.rollout_begin(self, via=f"{where}.resume")
            return resume(self, *args, **kwargs)
        return hooked

    def make_suspend(suspend):
        def hooked(self, *args, **kwargs):
            was_suspended = engine_suspended(self)
            out = suspend(self, *args, **kwargs)
            controller = current_controller()
            if controller is not None and not was_suspended:
                controller.rollout_end(self, via=f"{where}.suspend")
            return out
        return hooked

    ok = _replace(cls, "resume", make_resume) and _replace(cls, "suspend", make_suspend)
    if not ok:
        logger.warning("amem_callbacks: %s has no resume()/suspend(); this Megatron version "
                       "is not supported by the rollout hooks", where)
    return ok


def patch_interface(cls) -> bool:
    """Wrap ``cls.resume``/``cls.suspend`` (Megatron-LM's RL inference interface)."""
    where = f"{cls.__name__}"

    def engine_of(self):
        return getattr(self, "_inference_engine", None)

    def make_resume(resume):
        if inspect.iscoroutinefunction(resume):
            async def hooked(self, *args, **kwargs):
                controller = current_controller()
                if controller is not None:
                    controller.rollout_begin(engine_of(self), via=f"{where}.resume")
                return await resume(self, *args, **kwargs)
        else:
            def hooked(self, *args, **kwargs):
                controller = current_controller()
                if controller is not None:
                    controller.rollout_begin(engine_of(self), via=f"{where}.resume")
                return resume(self, *args, **kwargs)
        return hooked

    def make_suspend(suspend):
        if inspect.iscoroutinefunction(suspend):
            async def hooked(self, *args, **kwargs):
                out = await suspend(self, *args, **kwargs)
                controller = current_controller()
                if controller is not None:
                    controller.rollout_end(engine_of(self), via=f"{where}.suspend")
                return out
        else:
            def hooked(self, *args, **kwargs):
                out = suspend(self, *args, **kwargs)
                controller = current_controller()
                if controller is not None:
                    controller.rollout_end(engine_of(self), via=f"{where}.suspend")
                return out
        return hooked

    return _replace(cls, "resume", make_resume) and _replace(cls, "suspend", make_suspend)


def _patch_module(class_name, patch):
    def action(module):
        cls = getattr(module, class_name, None)
        if cls is None:
            logger.warning("amem_callbacks: %s has no %s; rollout hooks not installed there",
                           module.__name__, class_name)
            return
        patch(cls)
    return action


def install_hooks() -> None:
    """Patch the engine and the RL interface now or when they are imported (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    when_imported(ENGINE_MODULE, _patch_module(ENGINE_CLASS, patch_engine))
    when_imported(INTERFACE_MODULE, _patch_module(INTERFACE_CLASS, patch_interface))


def remove_hooks() -> None:
    """Undo every patch and forget the controller (for tests)."""
    global _installed
    with _lock:
        while _patched:
            cls, name, original = _patched.pop()
            setattr(cls, name, original)
        forget((ENGINE_MODULE, INTERFACE_MODULE))
        _installed = False
    set_controller(None)
