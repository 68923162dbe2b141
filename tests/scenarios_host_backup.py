"""Scenarios of the host-backup hook on gloo ranks with the stand-in NCCL's runtime
build (tests/fake_nccl/fake_nccl.c, "The runtime"): its suspends pin, zero and copy
into host blocks through a stand-in driver found by dlsym, as NCCL's do. Run by
tests/test_host_backup.py through tests.harness (one fresh process per rank: the
hook is process-wide)."""

from __future__ import annotations

import ctypes
import logging
import os

import torch.distributed as dist

from amem_callbacks import OffloadPolicy, host_backup
from tests.fake_nccl import FakeDriver
from tests.scenarios import FakeNccl, allreduce_ok, init, make_groups

ENTRIES, ENTRY_BYTES = 6, 64 * 1024
COMM_BYTES = ENTRIES * ENTRY_BYTES


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _job(args: dict, install_first: bool = True):
    """gloo groups, the fake NCCL with backups, a policy keeping tp; the policy made
    before the communicators (so its hook is in place when the runtime starts) unless
    ``install_first`` is False. Returns ``(groups, fake, driver, policy, log)``."""
    os.environ["FAKE_NCCL_DRIVER"] = args["driver"]
    log = _Lines()
    logging.getLogger("amem_callbacks").addHandler(log)
    init()
    groups = make_groups(dist.get_world_size())
    fake = FakeNccl("runtime", default_mib=32, backup=(ENTRIES, ENTRY_BYTES))

    def make_comms():
        for g in groups.values():
            fake.handle_of(g)

    if not install_first:
        make_comms()
    policy = OffloadPolicy(backend=fake.backend(), keep=["tp"], agree_timeout_s=20,
                           timeout_s=30, reuse_host_backup=args.get("reuse", True))
    if install_first:
        make_comms()
    return groups, fake, FakeDriver(args["driver"]), policy, log


def _fill(fake, value: int) -> None:
    for comm in fake.comms.values():
        ctypes.memset(fake.controls.image(comm, COMM_BYTES), value, COMM_BYTES)


def _holds(fake, value: int) -> dict:
    return {name: bytes(fake.controls.image(comm, COMM_BYTES)) == bytes([value]) * COMM_BYTES
            for name, comm in sorted(fake.comms.items())}


def _cycles(groups, fake, driver, policy, count: int) -> list:
    """``count`` begin/end cycles, a new byte pattern each, every group used after."""
    out = []
    for cycle in range(count):
        value = 16 * (cycle + 1) + dist.get_rank()
        _fill(fake, value)
        policy.begin("rollout")
        suspended = {n for n, s in fake.suspended().items() if s}
        policy.end("rollout")
        policy.wait()
        out.append({
            "suspended": sorted(suspended),
            "exact": _holds(fake, value),
            "collectives_ok": all(allreduce_ok(g) for g in groups.values()),
            "driver_pins": driver.pins, "driver_unpins": driver.unpins,
            "driver_registers": driver.registers, "driver_pinned_bytes": driver.pinned_bytes,
            "metrics": {k: v for k, v in policy.metrics(last=False).items()
                        if k.startswith("amem/host_backup/")},
        })
    return out


def scenario_keeps_backup(args):
    """Cycles with the hook installed before the communicators: the first suspend
    pins (by registration), the later ones reuse, every resume is exact; close() unpins
    what is kept."""
    groups, fake, driver, policy, log = _job(args)
    cycles = _cycles(groups, fake, driver, policy, args.get("cycles", 4))
    kept_before_close = host_backup.stats().get("kept_bytes", 0)
    policy.close()
    return {"cycles": cycles, "state": repr(host_backup.state()),
            "kept_before_close": kept_before_close,
            "after_close": {"kept_bytes": host_backup.stats().get("kept_bytes"),
                            "driver_pinned_bytes": driver.pinned_bytes,
                            "bad_frees": driver.bad_frees},
            "log": log.lines}


def scenario_late_install(args):
    """The communicators (and so the runtime) came before the policy: the backup is
    re-pinned every cycle, nothing breaks, and one line says why and what to do."""
    groups, fake, driver, policy, log = _job(args, install_first=False)
    cycles = _cycles(groups, fake, driver, policy, 3)
    policy.close()
    return {"cycles": cycles, "why": host_backup.why_inactive(), "log": log.lines,
            "bad_frees": driver.bad_frees}


class _BenchLoop:
    """What the bench's host-backup stage reads of its Loop, on gloo and the CPU."""

    def __init__(self, groups):
        import torch

        self.dist, self.sync = dist, dist.new_group(backend="gloo")
        self.groups, self.device = groups, torch.device("cpu")

    def all_groups(self):
        return list(self.groups.values())


def scenario_bench_stage(args):
    """The bench's P6 stage (tools/bench_backup.py), every line of it, on the fake runtime."""
    from amem_callbacks.tools.bench_backup import backup_cycles

    groups, fake, driver, policy, _log = _job(args)
    return backup_cycles(_BenchLoop(groups), fake.backend(), 2, 2)
