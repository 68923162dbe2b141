"""The process groups TRL's generation itself uses (trl 1.16; docs/trl.md): they stay active."""

from __future__ import annotations

import sys
from typing import Optional

from amem_callbacks.availability import is_distributed_initialized
from amem_callbacks.sharded import (groups_gathered_over, groups_generate_uses,
                                    guard_sees_all_collectives)


def generation_mode(trainer) -> Optional[str]:
    if not getattr(trainer, "use_vllm", False):
        return "transformers"
    mode = getattr(getattr(trainer, "vllm_generation", None), "mode", None)
    return f"vllm-{mode}" if mode in ("colocate", "server") else None


def groups_generation_uses(trainer, mode) -> list:
    """``(process group, role or None, why)`` for each group that generation itself
    calls: vLLM's, and those a sharded model's generation runs on
    (:func:`amem_callbacks.sharded.groups_generate_uses`)."""
    import torch.distributed as dist  # light import: torch at use

    if not is_distributed_initialized():
        return []
    world = dist.distributed_c10d._get_default_group()
    found = []
    vllm_generation = getattr(trainer, "vllm_generation", None)
    if mode == "vllm-colocate":
        tp_group = getattr(vllm_generation, "tp_group", None)
        if tp_group is not None:
            found.append((tp_group, "vllm_tp", "vLLM gathers the prompts over it"))
        found += [(group, "vllm", "vLLM's own group") for group in _vllm_own_groups()]
        if (getattr(vllm_generation, "tensor_parallel_size", 1) > 1
                and _is_peft(getattr(trainer, "model", None))):
            found.append((world, None, "TRL calls a barrier on it before each vLLM generate "
                                       "(PEFT with tensor_parallel_size > 1)"))
    # Generation that may sync weights again inside the phase (several calls per phase).
    resyncs = (mode == "vllm-colocate" and getattr(vllm_generation, "enable_sleep_mode", False)
               and any(getattr(trainer, name, None)
                       for name in ("tools", "rollout_func", "environment_factories")))
    sharding = _sharding(trainer)
    if sharding and mode == "transformers":
        found.extend(groups_generate_uses(_model(trainer), sharding, getattr(
            trainer, "use_transformers_continuous_batching", False)))
    elif sharding and resyncs:
        found.extend(groups_gathered_over(_model(trainer), sharding))
    return found


def _model(trainer):
    return getattr(trainer, "model_wrapped", None) or getattr(trainer, "model", None)


def _sharding(trainer) -> Optional[str]:
    backend = getattr(trainer, "_dist", None)
    if backend is not None:
        zero3, fsdp = getattr(backend, "is_zero3", False), getattr(backend, "is_fsdp", False)
    else:
        state = getattr(getattr(trainer, "accelerator", None), "state", None)
        zero3 = getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", 0) == 3
        fsdp = getattr(state, "fsdp_plugin", None) is not None
    return "DeepSpeed ZeRO-3" if zero3 else "FSDP" if fsdp else None


def _vllm_own_groups() -> list:
    """The NCCL groups of vLLM's GroupCoordinators (colocate mode builds them in this process)."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is None:
        return []
    groups = {}
    for value in list(vars(state).values()):
        group = getattr(value, "device_group", None) if not isinstance(value, type) else None
        if group is not None and hasattr(group, "group_name"):
            groups[id(group)] = group
    return list(groups.values())


def _is_peft(model) -> bool:
    try:
        from accelerate.utils import is_peft_model  # optional: accelerate
    except ImportError:
        return False
    return model is not None and is_peft_model(model)


def needs_settle_after_generate(trainer) -> bool:
    """Whether the resume must have finished before ``_generate`` returns: the
    collectives after generation may bypass the guard (see
    :func:`amem_callbacks.sharded.guard_sees_all_collectives`)."""
    return not guard_sees_all_collectives(_model(trainer))
