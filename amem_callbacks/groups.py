"""Every process group of this process, with a stable key, a readable name and
its communicator; and what a rollout does with each (:class:`RolloutGroups`).

The key is torch's ``group_name``: the same string on every member rank, so it
identifies a group across ranks (agreement keys, ordering). The name is what
people and ``keep`` lists use: a role an adapter gave it (Megatron's "dp",
"tp"), else the ``group_desc`` it was created with, else "world" for the
default group, else the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .availability import is_distributed_initialized
from .backends.base import CommMemory
from .errors import OptionError

# group key -> role, set by adapters or users before or after the policy exists.
_roles: dict = {}
# Role names ``keep`` accepts before the groups exist: "world", plus what the
# adapters (Megatron's parallel_state roles, TRL's vLLM groups, ...) register.
_vocabulary: set = {"world"}


def name_group(group, role: str) -> None:
    """Give a process group a role name (used in ``keep`` and in reports)."""
    if not isinstance(role, str) or not role:
        raise OptionError(f"a group role must be a non-empty string, got {role!r}")
    if not isinstance(getattr(group, "group_name", None), str):
        raise OptionError(f"name_group needs a process group (from init_process_group or "
                          f"new_group), got {group!r}")
    _roles[group.group_name] = role


def register_roles(names) -> None:
    """Declare role names that ``keep`` may list before any group has them (an
    adapter calls this with its framework's vocabulary when it is imported)."""
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise OptionError(f"role names are non-empty strings, got {bad!r}")
    _vocabulary.update(names)


def registered_roles() -> set:
    """Every role name known now: registered vocabularies and roles given to groups."""
    return _vocabulary | set(_roles.values())


def keep_name(group, role: Optional[str] = None) -> str:
    """A name for ``keep``: "world" for the default group, else ``role`` (given to
    the group as its name), else the group's key."""
    from torch.distributed import distributed_c10d as c10d  # light import: torch

    if group is c10d._get_default_group():
        return "world"
    if role:
        name_group(group, role)
        return role
    return group.group_name


def flatten_groups(value) -> list:
    """The process groups in ``value``: one group, None, or dicts/lists/tuples of them."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [g for v in value.values() for g in flatten_groups(v)]
    if isinstance(value, (list, tuple)):
        return [g for v in value for g in flatten_groups(v)]
    return [value]


@dataclass
class RoleGroup:
    """One process-group object, every role it serves on this rank, and whether a
    rollout keeps it active (and why)."""

    group: object
    name: str
    roles: list
    keep: bool = False
    why: str = ""


@dataclass
class RolloutGroups:
    """What a rollout does with each group of this rank (``mode``: how it generates)."""

    mode: str
    entries: list

    @property
    def groups(self) -> list:
        return [entry.group for entry in self.entries]

    @property
    def kept_names(self) -> list:
        return [entry.name for entry in self.entries if entry.keep]

    def describe(self) -> str:
        idle = [e.name for e in self.entries if not e.keep]
        return f"{self.mode} inference: keep {self.kept_names}, may suspend {idle}"

    def name_groups(self) -> None:
        """Give each group its role name for ``keep`` lists and reports."""
        for entry in self.entries:
            if entry.name != "world":
                name_group(entry.group, entry.name)


@dataclass
class GroupInfo:
    """One process group as this rank sees it."""

    group: object
    key: str
    name: str
    ranks: tuple
    handle: object = None
    why_no_handle: Optional[str] = None
    memory: Optional[CommMemory] = None
    memory_error: Optional[str] = None
    aliases: frozenset = field(default_factory=frozenset)
    transport: str = ""  # "intra-node" or "network (N hosts)", from the placement

    @property
    def size(self) -> int:
        return len(self.ranks)

    def matches(self, names) -> bool:
        return bool(self.aliases & set(names))


def _describe(group, default_group) -> tuple:
    key = group.group_name
    desc = getattr(group, "group_desc", "") or ""
    aliases = {key}
    if desc and desc not in ("undefined",):
        aliases.add(desc)
        # DeviceMesh creates "mesh_<dim>" descriptions; the bare dim name is the role.
        if desc.startswith("mesh_"):
            aliases.add(desc[len("mesh_"):])
    if group is default_group:
        aliases.add("world")
    role = _roles.get(key)
    if role:
        aliases.add(role)
    name = role or ("world" if group is default_group else None) or (
        desc if desc and desc not in ("undefined", "default_pg") else key)
    return key, name, frozenset(aliases)


def discover(backend, only=None, placement=None) -> list:
    """Every group this rank belongs to, sorted by key (the same order on all ranks).

    ``only`` restricts discovery to the given process groups; ``placement``
    (where every rank runs) tells each group's transport.
    """
    if not is_distributed_initialized():
        return []
    import torch.distributed as dist  # light import: torch (loaded, as is_distributed_initialized says)
    from torch.distributed import distributed_c10d as c10d

    default_group = c10d._get_default_group()
    groups = list(only) if only is not None else list(c10d._world.pg_map.keys())
    infos = []
    for group in groups:
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        key, name, aliases = _describe(group, default_group)
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        info = GroupInfo(group=group, key=key, name=name, ranks=ranks, aliases=aliases,
                         transport=placement.transport(ranks) if placement else "")
        info.handle, info.why_no_handle = backend.communicator(group)
        if info.handle is not None:
            try:
                info.memory = backend.memory(info.handle)
            except Exception as exc:  # stats are advisory; the plan says why it skipped
                info.memory_error = str(exc)
        infos.append(info)
    infos.sort(key=lambda info: info.key)
    return infos


def existing_group_names() -> set:
    """Every alias of the groups that exist now (empty before init_process_group)."""
    if not is_distributed_initialized():
        return set()
    from torch.distributed import distributed_c10d as c10d  # light import: torch

    default_group = c10d._get_default_group()
    names = set()
    for group in list(c10d._world.pg_map.keys()):
        names |= _describe(group, default_group)[2]
    return names
