"""Which process groups TRL's generation itself uses, per generation mode
(read from trl 1.16): those stay active while the rest is suspended."""

from __future__ import annotations

import sys
from typing import Optional


def generation_mode(trainer) -> Optional[str]:
    if not getattr(trainer, "use_vllm", False):
        return "transformers"
    mode = getattr(getattr(trainer, "vllm_generation", None), "mode", None)
    return f"vllm-{mode}" if mode in ("colocate", "server") else None


def groups_generation_uses(trainer, mode) -> list:
    """``(process group, role or None, why)`` for each group that generation itself calls."""
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
        why = f"{sharding} gathers parameters on it while generating"
        found.append((world, None, why))
        model = getattr(trainer, "model_wrapped", None) or getattr(trainer, "model", None)
        found.extend((group, None, why) for group in _sharding_groups(model))
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


def _sharding_groups(model) -> list:
    """Groups the parameters are sharded over: FSDP1 wrappers' ``process_group``,
    FSDP2 DTensors' mesh, ZeRO-3 parameters' ``ds_process_group``."""
    if model is None:
        return []
    groups = {}
    for module in model.modules():
        group = getattr(module, "process_group", None)
        if group is not None and type(module).__name__ == "FullyShardedDataParallel":
            groups[id(group)] = group
    for param in model.parameters():
        group = getattr(param, "ds_process_group", None)
        if group is not None:
            groups[id(group)] = group
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            for group in mesh.get_all_groups():
                groups[id(group)] = group
    return list(groups.values())


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
