"""Single-process cases of the host-backup hook, each run in a fresh interpreter by
tests/test_host_backup.py (``python -m tests.host_backup_cases CASE FOLDER``), since
the hook is installed once per process. Each prints one JSON line."""

from __future__ import annotations

import ctypes
import json
import os
import sys

from amem_callbacks import host_backup
from tests.fake_nccl import FakeControls, FakeDriver, build, build_driver

ENTRIES, ENTRY_BYTES = 4, 1 << 16
NBYTES = ENTRIES * ENTRY_BYTES


def _setup(folder: str, variant: str = "runtime"):
    driver_path = build_driver(folder)
    os.environ["FAKE_NCCL_DRIVER"] = driver_path
    return FakeControls(build(variant, folder)), FakeDriver(driver_path)


def _comm(fake):
    comm = fake.create(NBYTES)
    fake.set_backup(comm, ENTRIES, ENTRY_BYTES)
    return comm


def _cycle(fake, comm, value: int, windows: bool = True) -> bool:
    """One suspend and resume of ``comm`` with a new pattern; whether it came back exact."""
    image = fake.image(comm, NBYTES)
    ctypes.memset(image, value, NBYTES)
    suspend_window = host_backup.window(host_backup.SUSPEND) if windows else _nothing()
    with suspend_window:
        assert fake.suspend(comm) == 0
    assert bytes(image[:8]) == b"\xee" * 8  # the "device" bytes were released
    resume_window = host_backup.window(host_backup.RESUME) if windows else _nothing()
    with resume_window:
        assert fake.resume(comm) == 0
    return bytes(image) == bytes([value]) * NBYTES


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _figures(driver) -> dict:
    return {"pins": driver.pins, "unpins": driver.unpins, "registers": driver.registers,
            "unregisters": driver.unregisters, "pinned_bytes": driver.pinned_bytes,
            "bad_frees": driver.bad_frees, "stats": host_backup.stats()}


def reuse(folder, blocks=None, version=None, register_fails=False):
    """Installed before the runtime starts: the first cycle pins (by registration, by
    default), later ones reuse. ``blocks``: AMEM_HOST_BACKUP_BLOCKS; ``version``: the
    NCCL release the stand-in reports; ``register_fails``: the driver refuses it."""
    if blocks:
        os.environ[host_backup.ENV_BLOCKS] = blocks
    if version:
        os.environ["FAKE_NCCL_VERSION"] = version
    if register_fails:
        os.environ["FAKE_CUDA_REGISTER_FAILS"] = "1"
    fake, driver = _setup(folder)
    state = host_backup.install(fake.lib._name)
    comm = _comm(fake)
    host_backup.bound(NBYTES)
    exact = [_cycle(fake, comm, 10 + i) for i in range(5)]
    before_release = _figures(driver)
    released = host_backup.release()
    return {"state": state.__dict__, "exact": exact, "before_release": before_release,
            "released": released, "after_release": _figures(driver),
            "active": host_backup.active(), "metrics": host_backup.metrics()}


def allocated(folder):
    """AMEM_HOST_BACKUP_BLOCKS=allocated: new blocks from NCCL's own cuMemHostAlloc."""
    return reuse(folder, blocks="allocated")


def registered_refused(folder):
    """An NCCL release not read: new blocks pinned as NCCL asks, never registered."""
    return reuse(folder, version="22907")


def register_fails(folder):
    """A driver that refuses the registration: NCCL's own pinning, and no second try."""
    return reuse(folder, register_fails=True)


def bad_blocks_value(folder):
    """A bad AMEM_HOST_BACKUP_BLOCKS: the policy's start-up raises with what to write,
    and an install reached another way refuses, with the same words."""
    os.environ[host_backup.ENV_BLOCKS] = "pageable"
    fake, _driver = _setup(folder)
    from amem_callbacks import OffloadOptions

    try:
        host_backup.prepare(OffloadOptions(backend="nccl"))
        raised = ""
    except ValueError as bad:
        raised = str(bad)
    state = host_backup.install(fake.lib._name)
    return {"raised": raised, "state": state.__dict__}


def zeroing_kept(folder):
    """An NCCL release outside the ones read (FAKE_NCCL_VERSION=2.29.7): reuse, but every
    zeroing runs."""
    os.environ["FAKE_NCCL_VERSION"] = "22907"
    fake, driver = _setup(folder)
    host_backup.install(fake.lib._name)
    comm = _comm(fake)
    host_backup.bound(NBYTES)
    exact = [_cycle(fake, comm, 80 + i) for i in range(3)]
    return {"exact": exact, "stats": host_backup.stats()}


def bounded(folder):
    """A bound below one cycle's backup: only that much is kept, the rest unpinned."""
    fake, driver = _setup(folder)
    host_backup.install(fake.lib._name)
    comm = _comm(fake)
    host_backup.bound(ENTRY_BYTES * 2)
    exact = [_cycle(fake, comm, 20 + i) for i in range(3)]
    during = _figures(driver)
    host_backup.bound(0)
    return {"exact": exact, "during": during, "after_lowering": _figures(driver)}


def outside_windows(folder):
    """Frees outside a resume window (teardown) and allocations outside a suspend
    window (set-up) go to the driver as before."""
    fake, driver = _setup(folder)
    host_backup.install(fake.lib._name)
    comm = _comm(fake)
    host_backup.bound(NBYTES)
    exact = [_cycle(fake, comm, 30 + i, windows=False) for i in range(3)]
    return {"exact": exact, "figures": _figures(driver)}


def reuse_off(folder):
    """set_reuse(False): every cycle pins and unpins, nothing is kept."""
    fake, driver = _setup(folder)
    host_backup.install(fake.lib._name)
    comm = _comm(fake)
    host_backup.bound(NBYTES)
    _cycle(fake, comm, 1)
    kept_on = host_backup.stats()["kept_bytes"]
    host_backup.set_reuse(False)
    exact = [_cycle(fake, comm, 40 + i) for i in range(3)]
    return {"kept_while_on": kept_on, "exact": exact, "figures": _figures(driver),
            "why": host_backup.why_inactive()}


def switched_off(folder):
    """AMEM_HOST_BACKUP=0: not installed, NCCL's look-ups untouched."""
    os.environ[host_backup.ENV_SWITCH] = "0"
    fake, driver = _setup(folder)
    state = host_backup.install(fake.lib._name)
    comm = _comm(fake)
    exact = [_cycle(fake, comm, 50 + i) for i in range(2)]
    return {"state": state.__dict__, "exact": exact, "figures": _figures(driver)}


def late(folder):
    """The runtime reached the driver before the install: installed, never active,
    and why_inactive says so; cycles unchanged."""
    fake, driver = _setup(folder)
    comm = _comm(fake)  # the first communicator starts the runtime
    state = host_backup.install(fake.lib._name)
    exact = [_cycle(fake, comm, 60 + i) for i in range(2)]
    return {"state": state.__dict__, "active": host_backup.active(),
            "why": host_backup.why_inactive(), "exact": exact, "figures": _figures(driver)}


def refusals(folder):
    """An NCCL that imports no dlsym, and one not loaded: refused, nothing changed."""
    plain = FakeControls(build("suspend", folder))
    no_dlsym = host_backup.install(plain.lib._name)
    missing = host_backup.install(os.path.join(folder, "libnccl-not-loaded.so"))
    return {"no_dlsym": no_dlsym.__dict__, "not_loaded": missing.__dict__,
            "installed": host_backup.installed()}


def scoped(folder):
    """Only the NCCL it is installed in changes: RTLD_NEXT from that NCCL still finds
    its own dependency; a second NCCL copy and ctypes' own dlsym reach the real driver."""
    fake, driver = _setup(folder)
    probe = ctypes.CDLL(next(os.path.join(folder, f) for f in os.listdir(folder)
                             if f.startswith("libfake-probe-")))
    expected = ctypes.addressof(ctypes.c_int.in_dll(probe, "fake_probe_symbol"))
    before = fake.next_lookup("fake_probe_symbol")
    host_backup.install(fake.lib._name)
    after = fake.next_lookup("fake_probe_symbol")
    # a second copy of the "NCCL", at another path: its runtime is not ours
    other_folder = os.path.join(folder, "other")
    os.makedirs(other_folder, exist_ok=True)
    other = FakeControls(build("runtime", other_folder))
    other_comm = _comm(other)
    pins_before = driver.pins
    exact_other = [_cycle(other, other_comm, 70 + i) for i in range(3)]
    return {"expected": expected, "before": before, "after": after,
            "other_pins": driver.pins - pins_before, "exact_other": exact_other,
            "stats": host_backup.stats()}


CASES = {f.__name__: f for f in (reuse, allocated, registered_refused, register_fails,
                                 bad_blocks_value, zeroing_kept, bounded,
                                 outside_windows, reuse_off, switched_off, late, refusals,
                                 scoped)}

if __name__ == "__main__":
    print(json.dumps(CASES[sys.argv[1]](sys.argv[2])))
