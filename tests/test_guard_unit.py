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
    def _before_use(self, group, kind, call):
        self.calls.append((call, kind, group is dist.group.WORLD))
    def _forget(self, group):
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
