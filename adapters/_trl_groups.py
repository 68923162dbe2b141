"""Which process groups TRL's generation itself uses, per generation mode
(read from trl 1.16): those stay active while the rest is suspended."""

from __future__ import annotations

import sys
from typing import Optional

from amem_callbacks.sharded import groups_gathered_over, guard_sees_all_collectives


def generation_mode(trainer) -> Optional[str]:
    if not getattr(trainer, "use_vllm", False):
        return "transformers"
    mode = getattr(getattr(trainer, "vllm_generation", None), "mode", None)
    return f"vllm-{mode}" if mode in ("colocate", "server") else None


def groups_generation_uses(trainer, mode) -> list:
    """``(process group, role or None, why)`` for each group that generation itself calls.

    A sharded model (FSDP, ZeRO-3) gathers its parameters while it generates
    (see :func:`amem_callbacks.sharded.groups_gathered_over`), and transformers' generate then also all-reduces
    a finished flag on the default group after every token."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    world = dist.distributed_c10d._get_default_group()
    found = []
    vllm_generation = getattr(trainer, "vllm_generation", None)
    if mode == "vllm-colocate":
        tp_group = getattr(vllm_generation, "tp_group", None)
        if tp_group is not None:
            found.append((tp_group, "vllm_tp", "vLLM gathers the prompts over it"))
        for group in _vllm_own_groups():
            found.append((group, "vllm", "vLLM's own group"))
        if (getattr(vllm_generation, "tensor_parallel_size", 1) > 1
                and _is_peft(getattr(trainer, "model", None))):
            found.append((world, None, "TRL calls a barrier on it before each vLLM generate "
                                       "(PEFT with tensor_parallel_size > 1)"))
    # Generation that may sync weights again inside the phase (several calls per phase).
    several_calls = any(getattr(trainer, name, None) for name in
                        ("tools", "rollout_func", "environment_factories"))
    gathers = mode == "transformers" or (
        mode == "vllm-colocate" and getattr(vllm_generation, "enable_sleep_mode", False)
        and several_calls)
    sharding = _sharding(trainer)
    if gathers and sharding:
        model = getattr(trainer, "model_wrapped", None) or getattr(trainer, "model", None)
        sharded = groups_gathered_over(model, sharding)
        found.extend(sharded)
        if (mode == "transformers" and dist.get_world_size() > 1
                and not any(group is world for group, _, _ in sharded)):
            found.append((world, None, _finished_flag_why(trainer)))
    return found


def _sharding(trainer) -> Optional[str]:
    backend = getattr(trainer, "_dist", None)
    if backend is not None:
        if getattr(backend, "is_zero3", False):
            return "DeepSpeed ZeRO-3"
        if getattr(backend, "is_fsdp", False):
            return "FSDP"
        return None
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
        return "DeepSpeed ZeRO-3"
    if getattr(state, "fsdp_plugin", None) is not None:
        return "FSDP"
    return None


def _finished_flag_why(trainer) -> str:
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return ("transformers continuous batching of a sharded model (kept to be safe: its "
                "collectives were not checked)")
    # transformers' generate() turns synced_gpus on by itself for ZeRO-3 and
    # FSDP-managed models when the world has more than one rank.
    return ("transformers' generate all-reduces a finished flag on it after every token "
            "(synced_gpus, on for FSDP and ZeRO-3 models)")


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
        from accelerate.utils import is_peft_model
    except ImportError:
        return False
    return model is not None and is_peft_model(model)


def needs_settle_after_generate(trainer) -> bool:
    """Whether the resume must have finished before ``_generate`` returns: the
    collectives after generation may bypass the guard (see
    :func:`amem_callbacks.sharded.guard_sees_all_collectives`)."""
    model = getattr(trainer, "model_wrapped", None) or getattr(trainer, "model", None)
    return not guard_sees_all_collectives(model)
