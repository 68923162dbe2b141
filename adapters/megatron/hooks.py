"""Where a Megatron rollout begins and ends, hooked without editing Megatron.

Two seams; both are wrapped and the controller acts on whichever comes first
(a begin while a rollout is active, or an end while none is, is ignored):

* ``DynamicInferenceEngine.resume`` / ``.suspend`` (megatron-core): resume
  re-allocates the KV cache and suspend frees it. Megatron-LM's RL loop drives
  them from 0.17 on (its interface sends SUSPEND/RESUME to the engines). The
  wrapper acts only when the call really changes the engine's state (0.16's
  coordinator loop called ``resume()`` every 20 ms; 0.19 calls it once per
  RESUME signal).
* ``megatron.rl.inference.megatron.MegatronLocal.resume`` / ``.suspend``
  (Megatron-LM's RL inference interface, called once per rollout on every
  rank after the warm-up collectives). At core_v0.16.1 it only pauses and
  unpauses the engines and never calls the engine's suspend/resume; from 0.17
  on the first rollout finds the freshly launched engine running, so the
  engine's resume is not called either.

Begin runs before the wrapped resume, so the KV cache it allocates can use the
freed memory; end runs after the wrapped suspend, once the KV cache is gone.
On megatron-core 0.19.2 with Megatron-LM's ``train_rl.py`` (measured on GPU,
``results/one_h200/k_megatron_rl_0192``) each rollout begins at
``MegatronLocal.resume`` and ends at the engine's ``suspend``; the engine
allocates its KV cache at launch, before the first begin, so the freed memory
serves it from the second rollout on.
The modules are patched when they are first imported, so installing the hooks
imports neither torch nor Megatron.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Callable, Optional

from amem_callbacks.patching import Patches, forget, when_imported

logger = logging.getLogger("amem_callbacks")

ENGINE_MODULE = "megatron.core.inference.engines.dynamic_engine"
ENGINE_CLASS = "DynamicInferenceEngine"
INTERFACE_MODULE = "megatron.rl.inference.megatron"
INTERFACE_CLASS = "MegatronLocal"

_lock = threading.Lock()
_controller = None
#: builds a controller from Megatron's parsed args when none was installed
#: (the package sets it: it knows the flags; this module does not)
_from_megatron_args: Optional[Callable] = None
_installed = False
_patches = Patches()


# --- the controller the hooks report to -----------------------------------
def set_controller(controller) -> None:
    global _controller
    _controller = controller


def set_controller_source(source: Callable) -> None:
    """``source()`` builds a controller from Megatron's parsed args, or None."""
    global _from_megatron_args
    _from_megatron_args = source


def current_controller():
    """The installed controller; else one built from Megatron's parsed args
    (when ``add_args`` put the flags there); None while offloading is off."""
    global _controller
    if _controller is None and _from_megatron_args is not None:
        _controller = _from_megatron_args()
    return _controller if _controller is not None and _controller.enabled else None


# --- the seams ---------------------------------------------------------------
def engine_suspended(engine) -> bool:
    """The engine's own test in ``resume``: ``state`` (0.17+) or ``is_suspended``."""
    state = getattr(engine, "state", None)
    name = getattr(state, "name", None)
    if name is not None:
        return name in ("SUSPENDED", "SUSPENDING")
    return bool(getattr(engine, "is_suspended", False))


def _begin(engine, via: str) -> None:
    controller = current_controller()
    if controller is not None:
        controller.rollout_begin(engine, via=via)


def _end(engine, via: str) -> None:
    controller = current_controller()
    if controller is not None:
        controller.rollout_end(engine, via=via)


def patch_engine(cls) -> bool:
    """Wrap ``cls.resume``/``cls.suspend`` (a DynamicInferenceEngine class)."""
    where = cls.__name__

    def resume(original, self, *args, **kwargs):
        if engine_suspended(self):  # a real wake-up, not the coordinator's 20 ms poll
            _begin(self, f"{where}.resume")
        return original(self, *args, **kwargs)

    def suspend(original, self, *args, **kwargs):
        was_suspended = engine_suspended(self)
        out = original(self, *args, **kwargs)
        if not was_suspended:
            _end(self, f"{where}.suspend")
        return out

    ok = _patches.wrap(cls, "resume", resume) | _patches.wrap(cls, "suspend", suspend)
    if "resume" not in cls.__dict__ or "suspend" not in cls.__dict__:
        logger.warning("amem_callbacks: %s has no resume()/suspend(); this Megatron version "
                       "is not supported by the rollout hooks", where)
        return False
    return ok


def patch_interface(cls) -> bool:
    """Wrap ``cls.resume``/``cls.suspend`` (Megatron-LM's RL inference interface;
    sync or async, the wrappers follow)."""
    where = cls.__name__
    engine_of = lambda self: getattr(self, "_inference_engine", None)  # noqa: E731
    return (_patches.wrap(cls, "resume", before=lambda self, *a, **k: _begin(
                engine_of(self), f"{where}.resume"))
            | _patches.wrap(cls, "suspend", after=lambda result, self, *a, **k: _end(
                engine_of(self), f"{where}.suspend")))


def _patch_module(class_name: str, patch: Callable) -> Callable:
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
        _patches.undo()
        forget((ENGINE_MODULE, INTERFACE_MODULE))
        _installed = False
    set_controller(None)


def megatron_args():
    """Megatron-LM's global args, without importing megatron.training."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars else None
