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
    """``(process group, role or None, why)`` for each group that generation itself calls.

    A sharded model (FSDP, ZeRO-3) gathers its parameters while it generates
    (see ``_sharding_groups``), and transformers' generate then also all-reduces
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
        sharded = _sharding_groups(model, sharding)
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


def _sharding_groups(model, sharding: str = "FSDP") -> list:
    """``(group, role or None, why)`` for the groups a sharded model gathers its
    parameters over, default group first when it is one of them.

    FSDP2: what each module's FSDP state gathers over (its shard group, and the
    smaller group of ``reshard_after_forward=N``), and the groups of the mesh
    dims where a DTensor parameter is ``Shard`` (HSDP's ``Replicate`` dims serve
    only the backward all-reduce; tensor parallel dims are ``Shard`` too, and
    run in forward).
    FSDP1 wrappers' ``process_group`` (HYBRID_SHARD: the intra-node shard group)
    and ZeRO-3 parameters' ``ds_process_group``: the default group is kept too,
    as before (nothing public shows it unused). Nothing found: the default group.
    """
    import torch.distributed as dist

    world = dist.distributed_c10d._get_default_group()
    legacy_why = f"{sharding} gathers parameters on it while generating"
    found: dict = {}
    keep_world = False
    for module in model.modules() if model is not None else ():
        group = getattr(module, "process_group", None)
        if group is not None and type(module).__name__ == "FullyShardedDataParallel":
            found.setdefault(id(group), (group, None, legacy_why))
            keep_world = True
        for group, role, why in _fsdp2_state_groups(module):
            found.setdefault(id(group), (group, role, why))
    for param in model.parameters() if model is not None else ():
        group = getattr(param, "ds_process_group", None)
        if group is not None:
            found.setdefault(id(group), (group, None, legacy_why))
            keep_world = True
        mesh = getattr(param, "device_mesh", None)
        if mesh is None:
            continue
        names = getattr(mesh, "mesh_dim_names", None)
        for dim, placement in enumerate(getattr(param, "placements", ())):
            if not _is_shard(placement):
                continue
            role = names[dim] if names else None
            group = mesh.get_group(dim)
            found.setdefault(id(group), (group, role, _fsdp2_why(role if role else dim)))
    if keep_world or not found:
        found.setdefault(id(world), (world, None, legacy_why))
    return sorted(found.values(), key=lambda entry: entry[0] is not world)  # world first


def _is_shard(placement) -> bool:
    is_shard = getattr(placement, "is_shard", None)
    return bool(is_shard()) if callable(is_shard) else False


def _fsdp2_state_groups(module) -> list:
    """``(group, role, why)`` for what an FSDP2 module gathers over: its mesh's
    shard group and, with ``reshard_after_forward=N``, the smaller group it
    gathers over once resharded after a forward (a mesh of its own, on whichever
    parameters are resharded so at the time). Read from torch's private state
    (as torch 2.13 names it); where it is not found, nothing is added."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if not callable(get_state):
        return []
    try:
        state = get_state()
    except Exception:  # private API: no answer, nothing added
        return []
    param_groups = getattr(state, "_fsdp_param_groups", None)
    if param_groups is None:
        single = getattr(state, "_fsdp_param_group", None)
        param_groups = [single] if single is not None else []
    out = []
    for param_group in param_groups:
        for info, resharded in ((getattr(param_group, "mesh_info", None), False),
                                (getattr(param_group, "post_forward_mesh_info", None), True)):
            group = getattr(info, "shard_process_group", None)
            if group is None:
                continue
            if resharded:
                out.append((group, None, "FSDP2 all-gathers parameters resharded after forward "
                                         "(reshard_after_forward=N) over it while generating"))
                continue
            names = getattr(getattr(info, "mesh", None), "mesh_dim_names", None)
            dim = getattr(info, "shard_mesh_dim", None)
            role = names[dim] if names and dim is not None else None
            out.append((group, role, _fsdp2_why(role if role else dim)))
    return out


def _fsdp2_why(dim) -> str:
    return f"FSDP2 all-gathers parameters over mesh dim {dim} while generating"


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
    """Whether the collectives after generation may bypass the guard, so the
    resume must have finished before ``_generate`` returns.

    torch DDP's reducer (gradient all-reduce, buffer broadcast) calls the C++
    process group directly. FSDP2 (``fully_shard``, what accelerate's FSDP2
    and HSDP build) issues its all-gathers and reduce-scatters through
    ``torch.distributed``'s Python functions, which the guard holds back
    until their group is back; so does DeepSpeed's ``deepspeed.comm``. Any
    other or unknown wrapping settles, to be safe.
    """
    model = getattr(trainer, "model_wrapped", None) or getattr(trainer, "model", None)
    sharding = _sharding(trainer)
    if sharding == "FSDP2" or _is_fsdp2(model):
        return _has_ddp(model)
    return True


def _is_fsdp2(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def _has_ddp(model) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    modules = model.modules() if hasattr(model, "modules") else ()
    return any(isinstance(m, DistributedDataParallel) for m in modules)
