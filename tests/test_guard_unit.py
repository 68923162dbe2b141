"""The guard's wrapping itself, in one process on a 1-rank gloo group."""

import os
import subprocess
import sys

SCRIPT = r"""
import os, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed import all_gather_into_tensor as bound_gather   # bound before install
from amem_callbacks import guard
from amem_callbacks.patching import original_of
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
PG = dist.ProcessGroup
raw = {n: PG.__dict__[n] for n in guard.GUARDED_METHODS if n in PG.__dict__}
functions = (dist.all_reduce, dist.isend, dist.new_group)
guard.install(); guard.install()  # idempotent
assert dist.all_reduce is functions[0] and dist.isend is functions[1]  # torch's functions untouched
assert dist.new_group is not functions[2] and original_of(dist.new_group) is functions[2]

class Owner:
    calls = []
    def before_use(self, group, kind, call):
        self.calls.append((call, kind.value, group is dist.group.WORLD))
    def forget(self, group):
        self.calls.append(("forget", group is dist.group.WORLD))

t = torch.ones(2)
dist.all_reduce(t)                       # nothing watched: straight through
assert Owner.calls == []
world = dist.group.WORLD
owner = Owner()
guard.watch(world, owner)
dist.all_reduce(t)
dist.broadcast(t, 0, world)
dist.barrier()
out = [None]; dist.all_gather_object(out, 1)
bound_gather(torch.empty(2), t)
# Megatron's distributed-optimizer pattern: bound names inside an async coalescing manager.
with c10d._coalescing_manager(world, async_ops=True) as cm:
    bound_gather(torch.empty(2), t, group=world, async_op=True)
    bound_gather(torch.empty(2), t, group=world, async_op=True)
cm.wait()
world.allreduce([t])                     # a ProcessGroup method called directly
op = dist.P2POp(dist.isend, t, 0)        # torch's identity checks still pass
names = [c[0] for c in Owner.calls]
gathers = {"_allgather_base", "all_gather_single"}
coalesced = {"allgather_into_tensor_coalesced", "all_gather_single_coalesced"}
assert names[:3] == ["allreduce", "broadcast", "barrier"], names
assert any(n == "allgather" for n in names[3:]), names        # all_gather_object
assert sum(n in gathers for n in names) == 1, names           # the bound name
assert sum(n in coalesced for n in names) == 1, names         # the coalesced fast path
assert names[-1] == "allreduce" and all(c[2] for c in Owner.calls), Owner.calls
n_before = len(Owner.calls)
other = dist.new_group([0], backend="gloo", use_local_synchronization=True)
dist.all_reduce(t, group=other)          # a group nobody watches: not reported
assert len(Owner.calls) == n_before, Owner.calls[n_before:]
# Two owners of one group (one policy's overlapped end still running while another
# begins): each is asked, and one letting go leaves the other's hold in place.
class Second(Owner):
    calls = []
second = Second()
guard.watch(world, second)
guard.watch(world, second)               # watching twice: still asked once per call
dist.all_reduce(t)
assert len(Owner.calls) == n_before + 1 and len(Second.calls) == 1, (Owner.calls, Second.calls)
guard.unwatch(world, owner)
dist.all_reduce(t)
assert len(Owner.calls) == n_before + 1 and len(Second.calls) == 2
assert guard.watched() == [world]
n_before = len(Owner.calls)
guard.unwatch(world, second)             # nothing watched: everything put back
assert {n: PG.__dict__[n] for n in raw} == raw and dist.new_group is functions[2]
dist.all_reduce(t)
assert len(Owner.calls) == n_before
print("OK")
"""


def test_guard_sees_every_python_path_and_unwraps():
    from tests.harness import free_port

    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=dict(os.environ, PORT=str(free_port())), timeout=120)
    assert out.stdout.strip().endswith("OK"), out.stdout[-2000:] + out.stderr[-3000:]


def test_a_wrapper_installed_before_the_guard_stays_underneath():
    """A tracer (or the tests' strict stand-in) that wrapped a method first is
    what the guard calls and what it puts back."""
    import torch.distributed as dist

    from amem_callbacks import guard
    from amem_callbacks.patching import original_of

    cls = dist.ProcessGroup
    raw = cls.__dict__["barrier"]
    seen = []

    def tracer(self, *a, **k):
        seen.append("tracer")

    cls.barrier = tracer
    try:
        guard.install()
        assert original_of(cls.__dict__["barrier"]) is tracer
        guard.uninstall()
        assert cls.__dict__["barrier"] is tracer
    finally:
        guard.uninstall()
        cls.barrier = raw
