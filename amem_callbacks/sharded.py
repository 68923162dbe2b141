"""Which process groups a sharded model gathers its parameters over in a forward
(and which transformers' ``generate()`` of it runs collectives on).

A rollout that runs the training model itself (TRL's transformers generation,
a verl or plain-torch loop that generates with the FSDP model) must keep these
groups active. Read from the model, without importing any framework: FSDP2
(``fully_shard``) state and DTensor placements as torch 2.13 names them,
FSDP1 wrappers' ``process_group``, and DeepSpeed ZeRO-3's ``ds_process_group``
on parameters.
"""

from __future__ import annotations


def groups_gathered_over(model, sharding: str = "FSDP") -> list:
    """``(group, role or None, why)`` for each group ``model`` gathers its
    parameters over, the default group first when it is one of them.

    FSDP2: each module's shard group, the smaller group of
    ``reshard_after_forward=N``, and the mesh dims where a DTensor parameter is
    ``Shard`` (tensor-parallel dims are ``Shard`` too and run in forward; HSDP's
    ``Replicate`` dims serve only the backward all-reduce). FSDP1 and ZeRO-3:
    their group, and the default group too (nothing public shows it unused).
    Nothing found: the default group. ``sharding`` names the wrapper in the why.
    """
    import torch.distributed as dist  # light import: torch at use

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
        names = getattr(mesh, "mesh_dim_names", None)
        for dim, placement in enumerate(getattr(param, "placements", ()) if mesh else ()):
            if callable(getattr(placement, "is_shard", None)) and placement.is_shard():
                role, group = (names[dim] if names else None), mesh.get_group(dim)
                found.setdefault(id(group), (group, role, _why(role if role else dim)))
    if keep_world or not found:
        found.setdefault(id(world), (world, None, legacy_why))
    return sorted(found.values(), key=lambda entry: entry[0] is not world)  # world first


def groups_generate_uses(model, sharding: str = "FSDP", continuous_batching: bool = False) -> list:
    """What transformers' ``generate()`` of a sharded ``model`` runs collectives on:
    :func:`groups_gathered_over`, and the default group, where it all-reduces a
    finished flag after every token when the world has more than one rank."""
    import torch.distributed as dist  # light import: torch at use

    world = dist.distributed_c10d._get_default_group()
    found = groups_gathered_over(model, sharding)
    if dist.get_world_size() > 1 and not any(group is world for group, _, _ in found):
        # generate() turns synced_gpus on by itself for ZeRO-3 and FSDP-managed models
        why = ("transformers continuous batching of a sharded model (kept to be safe: its "
               "collectives were not checked)" if continuous_batching else
               "transformers' generate all-reduces a finished flag on it after every token "
               "(synced_gpus, on for FSDP and ZeRO-3 models)")
        found.append((world, None, why))
    return found


def _fsdp2_state_groups(module) -> list:
    """What an FSDP2 module gathers over, from torch's private state; where it
    is not found, nothing."""
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
        info = getattr(param_group, "mesh_info", None)
        group = getattr(info, "shard_process_group", None)
        if group is not None:
            names = getattr(getattr(info, "mesh", None), "mesh_dim_names", None)
            dim = getattr(info, "shard_mesh_dim", None)
            role = names[dim] if names and dim is not None else None
            out.append((group, role, _why(role if role else dim)))
        resharded = getattr(getattr(param_group, "post_forward_mesh_info", None),
                            "shard_process_group", None)
        if resharded is not None:
            out.append((resharded, None, "FSDP2 all-gathers parameters resharded after forward "
                                         "(reshard_after_forward=N) over it while generating"))
    return out


def _why(dim) -> str:
    return f"FSDP2 all-gathers parameters over mesh dim {dim} while generating"


def guard_sees_all_collectives(model) -> bool:
    """Whether every collective of ``model``'s training passes through the guard.

    FSDP2 (``fully_shard`` on the model, what accelerate's FSDP2 and HSDP build)
    issues its all-gathers and reduce-scatters through ProcessGroup methods,
    which the guard holds back until their group is back. torch DDP's reducer
    calls the C++ process group directly. Any other or unknown wrapping counts
    as not seen, to be safe.
    """
    from torch.nn.parallel import DistributedDataParallel  # light import: torch at use

    try:  # FSDP2's class, absent from older torch
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule) and not any(
        isinstance(m, DistributedDataParallel) for m in model.modules())
