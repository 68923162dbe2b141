"""Megatron's process groups by their ``parallel_state`` role, and which of
them a rollout leaves idle (read from the module globals: docs/megatron.md)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Optional

from amem_callbacks.groups import RoleGroup, RolloutGroups, flatten_groups

#: (role, parallel_state global). The order decides the name of a group object
#: that serves several roles (e.g. ``intra_dp_cp`` is the ``dp_cp`` group itself
#: when there is one distributed-optimizer instance).
ROLES = (
    ("tp", "_TENSOR_MODEL_PARALLEL_GROUP"),
    ("pp", "_PIPELINE_MODEL_PARALLEL_GROUP"),
    ("mp", "_MODEL_PARALLEL_GROUP"),
    ("ep", "_EXPERT_MODEL_PARALLEL_GROUP"),
    ("expert_tp", "_EXPERT_TENSOR_PARALLEL_GROUP"),
    ("tp_ep", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP"),
    ("tp_ep_pp", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP"),
    ("tp_cp", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP"),
    ("embd", "_EMBEDDING_GROUP"),
    ("pos_embd", "_POSITION_EMBEDDING_GROUP"),
    ("dp", "_DATA_PARALLEL_GROUP"),
    ("dp_cp", "_DATA_PARALLEL_GROUP_WITH_CP"),
    ("dp_cp_ag", "_DATA_PARALLEL_GROUP_WITH_CP_AG"),
    ("intra_dp_cp", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"),
    ("hybrid_dp_cp", "_HYBRID_DP_CP_GROUPS"),
    ("cp", "_CONTEXT_PARALLEL_GROUP"),
    ("hierarchical_cp", "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"),
    ("tp_dp", "_TENSOR_AND_DATA_PARALLEL_GROUP"),
    ("tp_dp_cp", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP"),
    ("expert_dp", "_EXPERT_DATA_PARALLEL_GROUP"),
    ("intra_expert_dp", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP"),
    ("inter_dist_opt", "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP"),
    ("intra_dist_opt", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"),
)

#: (role, the ``group_desc`` Megatron creates it with): groups kept outside
#: ``parallel_state``'s globals, found among the process's groups by their
#: description. megatron-core 0.19 makes the all-gather twins of the data-parallel
#: groups (``--create-all-gather-group``) in ``create_all_gather_groups`` and keeps
#: them only on the model's ProcessGroupCollection; 0.16 kept the first as a global.
DESCRIBED = (
    ("dp_cp_ag", "DATA_PARALLEL_GROUP_WITH_CP_AG"),
    ("expert_dp_ag", "EXPERT_DATA_PARALLEL_GROUP_AG"),
)

#: Groups inside one model replica, which in-place inference may use: the
#: engine runs tensor, pipeline and expert collectives on them. Every group
#: that spans data-parallel replicas (world, dp, dp_cp, tp_dp, expert_dp, the
#: distributed-optimizer groups) cannot be used by per-replica inference, and
#: dynamic inference runs without context parallelism (cp).
KEEP_IN_PLACE = frozenset(
    ("tp", "pp", "mp", "ep", "expert_tp", "tp_ep", "tp_ep_pp", "tp_cp", "embd", "pos_embd"))

#: Names ``--rl-amem-keep-groups`` accepts.
VALID_KEEP = frozenset(["world"] + [role for role, _ in ROLES + DESCRIBED])

#: Megatron's ``ProcessGroupCollection`` field names for the same roles.
ALIASES = {"expt_tp": "expert_tp", "expt_dp": "expert_dp", "intra_expt_dp": "intra_expert_dp",
           "hcp": "hierarchical_cp", "expt_dp_ag": "expert_dp_ag"}

IN_PLACE = "in-place"
SEPARATE = "separate"


def _parallel_state():
    return importlib.import_module("megatron.core.parallel_state")


def is_initialized(ps=None) -> bool:
    ps = ps or _parallel_state()
    return getattr(ps, "_DATA_PARALLEL_GROUP", None) is not None


def parallel_state_groups(ps=None) -> list:
    """Every distinct group object of ``parallel_state`` this rank is in, the
    default group first, each with its roles."""
    import torch.distributed as dist  # light import: torch at use
    from torch.distributed import distributed_c10d as c10d  # light import: torch at use (both)

    ps = ps or _parallel_state()
    entries, by_id = [], {}

    def add(group, role):
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
            return
        entry = by_id.get(id(group))
        if entry is None:
            entry = by_id[id(group)] = RoleGroup(group=group, name=role, roles=[])
            entries.append(entry)
        if role not in entry.roles:
            entry.roles.append(role)

    add(c10d._get_default_group(), "world")
    for role, attribute in ROLES:
        for group in flatten_groups(getattr(ps, attribute, None)):
            add(group, role)
    described = dict((desc, role) for role, desc in DESCRIBED)
    for group in list(c10d._world.pg_map.keys()):  # this rank's groups, in creation order
        role = described.get(getattr(group, "group_desc", None))
        if role is not None:
            add(group, role)
    return entries


def engine_groups(engine) -> list:
    """``(field, group)`` for each group in the engine's ``pg_collection``."""
    collection = getattr(engine, "pg_collection", None)
    if collection is None:
        return []
    names = ([f.name for f in dataclasses.fields(collection)]
             if dataclasses.is_dataclass(collection) else list(vars(collection)))
    # fields are init=False: the ones a collection was not given are unset
    return [(name, group) for name in names
            for group in flatten_groups(getattr(collection, name, None))]


def rollout_mode(engine, ps=None) -> str:
    """In-place when the engine runs on the training model's tensor-parallel
    group; separate when it has its own (``--rl-inference-*-parallel-size``)."""
    ps = ps or _parallel_state()
    tp = getattr(getattr(engine, "pg_collection", None), "tp", None)
    if tp is None or tp is getattr(ps, "_TENSOR_MODEL_PARALLEL_GROUP", None):
        return IN_PLACE
    return SEPARATE


def classify(engine, keep=(), ps=None, mode: Optional[str] = None) -> RolloutGroups:
    """Which groups a rollout on ``engine`` (None: in-place) keeps active and which
    it may suspend (docs/megatron.md); a separate inference model's own groups are
    added as ``inference_<field>``. ``keep``: more roles to keep; ``ps``: the
    ``parallel_state`` module (tests pass theirs); ``mode``: IN_PLACE or SEPARATE."""
    ps = ps or _parallel_state()
    mode = mode or rollout_mode(engine, ps)
    keep = {ALIASES.get(name, name) for name in keep}
    entries = parallel_state_groups(ps)
    used_by_engine = {id(group) for _, group in engine_groups(engine)}
    if mode == SEPARATE:
        known = {id(entry.group) for entry in entries}
        for field, group in engine_groups(engine):
            if id(group) not in known:
                known.add(id(group))
                entries.append(RoleGroup(group=group, name=f"inference_{field}",
                                         roles=[f"inference_{field}"], keep=True,
                                         why="the inference model's own group"))
    for entry in entries:
        if entry.keep:
            continue
        asked = sorted(set(entry.roles) & keep)
        if asked:
            entry.keep, entry.why = True, f"--rl-amem-keep-groups {','.join(asked)}"
        elif mode == IN_PLACE and set(entry.roles) & KEEP_IN_PLACE:
            entry.keep, entry.why = True, "in-place inference may use it (inside one model replica)"
        elif mode == SEPARATE and id(entry.group) in used_by_engine:
            entry.keep, entry.why = True, "the inference engine uses it"
    return RolloutGroups(mode=mode, entries=entries)
