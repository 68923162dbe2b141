"""Finish Megatron's deferred parameter all-gather (``--overlap-param-gather``) before a
rollout suspends its group, and turn the pre-hooks back on after it (why: docs/megatron.md)."""

from __future__ import annotations

import weakref

from amem_callbacks.log import logger

DDP_MODULE = "megatron.core.distributed.distributed_data_parallel"
DDP_CLASS = "DistributedDataParallel"

#: every Megatron DDP chunk built while the hooks were installed
_chunks: "weakref.WeakSet" = weakref.WeakSet()


def track(cls, patches) -> None:
    """Record every DistributedDataParallel built from now on (``__init__``
    wrapped through ``patches``, so the adapter's undo removes it)."""
    def init(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        _chunks.add(self)

    patches.wrap(cls, "__init__", init)


def _is_megatron_ddp(module) -> bool:
    cls = type(module)  # torch's DDP has the same class name
    return cls.__name__ == DDP_CLASS and cls.__module__.startswith("megatron.")


def hooks_on(chunk) -> bool:
    """The chunk defers its parameter all-gather to forward pre-hooks right now."""
    return bool(getattr(chunk, "use_forward_hook", False)) and bool(
        getattr(chunk, "remove_forward_pre_hook_handles", None))


def _reuses_grad_buffer(chunk) -> bool:
    config = getattr(chunk, "ddp_config", None)
    return bool(getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False))


def _ddp_chunks(model) -> list:
    """The Megatron DDP wrappers in ``model`` (a chunk list, one module, or None: all tracked)."""
    if model is None:
        return list(_chunks)
    found = []
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        modules = chunk.modules() if hasattr(chunk, "modules") else ()
        ddp = next((m for m in modules if _is_megatron_ddp(m) or m in _chunks), None)
        if ddp is not None or chunk in _chunks:
            found.append(ddp if ddp is not None else chunk)
    return found


def finish_before_suspend(model=None, optimizer=None) -> list:
    """Gather the deferred parameters now and turn the pre-hooks off; returns
    the chunks to turn back on after the rollout (:func:`restore`)."""
    chunks = [c for c in _ddp_chunks(model) if hooks_on(c)]
    staged = optimizer is not None and hasattr(optimizer, "prepare_model_params_for_param_sync")
    if chunks and staged:
        optimizer.prepare_model_params_for_param_sync()
    done = []
    for chunk in chunks:
        if _reuses_grad_buffer(chunk) and not staged:
            continue  # cannot stage without the optimizer: deferred_groups keeps its groups
        chunk.disable_forward_pre_hook(param_sync=True)
        done.append(chunk)
    if done:
        logger.info("amem_callbacks: finished the deferred parameter all-gather of %d model "
                    "chunk(s) before the rollout (--overlap-param-gather); their forward "
                    "pre-hooks are off until it ends", len(done))
    return done


def restore(chunks) -> None:
    """Turn back on the pre-hooks :func:`finish_before_suspend` turned off."""
    for chunk in chunks:
        if getattr(chunk, "use_forward_hook", False) and not hooks_on(chunk):
            chunk.enable_forward_pre_hook()
