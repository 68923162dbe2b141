"""The plan is a pure function of what one rank sees."""

from amem_callbacks.backends.base import CommMemory
from amem_callbacks.groups import GroupInfo
from amem_callbacks.plan import make_plan
from amem_callbacks.states import Verdict

KEEP, SUSPEND = Verdict.KEEP, Verdict.SUSPEND

MiB = 2**20


def group(key, name, handle=None, mib=480, suspended=False, why=None, aliases=()):
    memory = CommMemory(mib * MiB, 4 * MiB, (mib + 4) * MiB, suspended) if handle else None
    return GroupInfo(group=object(), key=key, name=name, ranks=(0, 1), handle=handle,
                     why_no_handle=why, memory=memory,
                     aliases=frozenset({key, name, *aliases}))


def plan(groups, keep=(), min_bytes=16 * MiB, host_cap=None, process_wide=False):
    return make_plan(groups, "rollout", frozenset(keep), min_bytes, host_cap, process_wide, "nccl")


def test_each_reason_to_keep_a_group():
    groups = [
        group("0", "world", handle=1),
        group("1", "tp", handle=2),
        group("2", "gloo_side", why="not an NCCL group"),
        group("3", "tiny", handle=3, mib=2),
        group("4", "already", handle=4, suspended=True),
        group("5", "twin", handle=1),
        group("6", "dp", handle=5),
    ]
    decisions = {d.name: d for d in plan(groups, keep={"tp"})}
    assert decisions["world"].action == SUSPEND and decisions["dp"].action == SUSPEND
    assert decisions["tp"].reason == "kept active for phase 'rollout'"
    assert decisions["gloo_side"].reason == "not an NCCL group"
    assert "2.0 MiB < min_bytes 16.0 MiB" in decisions["tiny"].reason
    assert "already suspended" in decisions["already"].reason
    assert decisions["twin"].reason == "shares its communicator with world"
    assert [d.key for d in plan(groups)] == [g.key for g in groups], "order is the input's"


def test_keep_matches_any_alias():
    groups = [group("7", "mesh_tp", handle=1, aliases=("tp",))]
    assert plan(groups, keep={"tp"})[0].action == KEEP


def test_host_memory_cap_keeps_groups_past_it_in_order():
    groups = [group(str(i), f"g{i}", handle=i + 1, mib=100) for i in range(4)]
    actions = [d.action for d in plan(groups, host_cap=250 * MiB)]
    assert actions == [SUSPEND, SUSPEND, KEEP, KEEP]
    assert "host memory cap" in plan(groups, host_cap=250 * MiB)[2].reason


def test_process_wide_backend_refuses_when_an_nccl_group_must_stay_active():
    groups = [group("0", "world", handle=1), group("1", "tp", handle=2)]
    decisions = plan(groups, keep={"tp"}, process_wide=True)
    assert all(d.action == KEEP for d in decisions)
    assert "cannot keep ['tp'] active" in decisions[0].reason
    assert [d.action for d in plan(groups, process_wide=True)] == [SUSPEND, SUSPEND]


def test_unknown_memory_does_not_block_a_dry_run():
    info = GroupInfo(group=object(), key="0", name="world", ranks=(0,), handle=object())
    assert plan([info])[0].action == SUSPEND
