"""The guard's wrapping itself, in one process on a 1-rank gloo group."""

import os
import subprocess
import sys


SCRIPT = r"""
import inspect, os, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from amem_callbacks import guard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
original = dist.all_reduce
guard.install(); guard.install()  # idempotent
assert dist.all_reduce is c10d.all_reduce and dist.all_reduce.__amem_original__ is original
assert inspect.signature(dist.all_reduce) == inspect.signature(original)
assert dist.isend is c10d.isend and not hasattr(dist.isend, "__amem_original__")

class Owner:
    calls = []
    def before_use(self, group, kind, call):
        self.calls.append((call, kind, group is dist.group.WORLD))
    def forget(self, group):
        self.calls.append(("forget", group is dist.group.WORLD))

t = torch.ones(2)
dist.all_reduce(t)                       # nothing watched: straight through
assert Owner.calls == []
guard.watch(dist.group.WORLD, Owner())
dist.all_reduce(t)                       # default group resolved from group=None
dist.all_reduce(t, group=dist.group.WORLD)
dist.broadcast(t, 0, dist.group.WORLD)   # group passed positionally
dist.barrier()
out = [None]; dist.all_gather_object(out, 1)
op = dist.P2POp(dist.isend, t, 0)        # identity checks in torch still pass
assert [c[0] for c in Owner.calls] == ["all_reduce", "all_reduce", "broadcast", "barrier",
                                        "all_gather_object", "all_gather", "all_gather"], Owner.calls
assert all(c[2] for c in Owner.calls)
guard.unwatch(dist.group.WORLD)
guard.uninstall()
assert dist.all_reduce is original and c10d.all_reduce is original
print("OK")
"""


def test_guard_wraps_resolves_groups_and_unwraps():
    from tests.harness import free_port

    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=dict(os.environ, PORT=str(free_port())), timeout=120)
    assert out.stdout.strip().endswith("OK"), out.stderr[-3000:]


def test_the_fast_wrapper_binds_arguments_exactly_like_the_original():
    """Every parameter kind torch could use: positional-only, defaults, *args,
    keyword-only, **kwargs; the group found wherever it is passed; the
    original's signature and behaviour unchanged."""
    import inspect

    from amem_callbacks import guard

    def original(tensor, /, op="sum", group=None, *rest, async_op=False, **extra):
        return (tensor, op, group, rest, async_op, extra)

    seen = []

    class Owner:
        def before_use(self, group, kind, call):
            seen.append((call, kind, group))

    wrapped = guard._wrap(original, guard.CallKind.COLLECTIVE, "group")
    assert "amem_callbacks guard" in wrapped.__code__.co_filename  # the fast path was taken
    assert inspect.signature(wrapped) == inspect.signature(original)
    calls = [((1,), {}), ((1, "max", "g"), {}), ((1,), {"group": "g", "async_op": True}),
             ((1, "max", "k", 5, 6), {"flag": 7}), ((1,), {"op": "min"})]
    for args, kwargs in calls:  # nothing watched: straight through, same result
        assert wrapped(*args, **kwargs) == original(*args, **kwargs)
    assert seen == []
    guard._guarded["g"] = Owner()
    try:
        assert wrapped(1, "max", "g") == original(1, "max", "g")
        assert wrapped(1, group="g") == original(1, group="g")
        wrapped(1, group="k")  # a group nobody watches: not reported
    finally:
        guard._guarded.pop("g")
    assert seen == [("original", guard.CallKind.COLLECTIVE, "g")] * 2


def test_an_unmirrorable_signature_falls_back_to_the_generic_wrapper():
    from amem_callbacks import guard

    def original(tensor, _amem_fn=None, group=None):  # a name the fast wrapper reserves
        return (tensor, _amem_fn, group)

    wrapped = guard._wrap(original, guard.CallKind.COLLECTIVE, "group")
    assert "amem_callbacks guard" not in wrapped.__code__.co_filename
    assert wrapped(1, 2, group=3) == (1, 2, 3)
