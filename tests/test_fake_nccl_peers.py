"""The stand-in NCCL's peer wait: a suspend or resume of a communicator given its
peers returns only once every member has called it, as NCCL's bootstrap barrier
does, and says so when one never comes (where NCCL would wait forever)."""

import threading
import time

from amem_callbacks.nccl_library import NcclLibrary
from tests.fake_nccl import FakeControls, build

MiB = 2**20


def _members(fake_nccl_dir, tmp_path, count=2):
    lib = NcclLibrary.open(build("suspend", fake_nccl_dir))
    controls = FakeControls(lib.path)
    comms = [controls.create(64 * MiB) for _ in range(count)]
    for rank, comm in enumerate(comms):  # one process playing every rank of one group
        controls.set_peers(comm, str(tmp_path / "dp"), rank, count)
    return lib, controls, comms


def test_a_members_suspend_returns_when_the_last_member_comes(fake_nccl_dir, tmp_path):
    lib, controls, (first, last) = _members(fake_nccl_dir, tmp_path)
    returned = {}

    def suspend_first():
        lib.comm_suspend(first)
        returned["at"] = time.monotonic()

    thread = threading.Thread(target=suspend_first)
    thread.start()
    time.sleep(0.3)
    assert controls.in_barrier(first) and not controls.suspended(first)  # waiting for its peer
    came = time.monotonic()
    lib.comm_suspend(last)
    thread.join(10)
    assert returned["at"] >= came and controls.suspended(first) and controls.suspended(last)
    # the resume waits too, in the next round
    thread = threading.Thread(target=lib.comm_resume, args=(first,))
    thread.start()
    time.sleep(0.2)
    assert controls.in_barrier(first) and controls.suspended(first)
    lib.comm_resume(last)
    thread.join(10)
    assert not controls.suspended(first) and not controls.suspended(last)
    assert not controls.peer_timed_out(first) and not controls.peer_timed_out(last)


def test_a_member_that_never_comes_ends_the_wait_with_an_error(fake_nccl_dir, tmp_path,
                                                               monkeypatch):
    lib, controls, (alone, _absent) = _members(fake_nccl_dir, tmp_path)
    monkeypatch.setenv("FAKE_NCCL_PEER_WAIT_S", "0.3")
    began = time.monotonic()
    assert controls.suspend(alone) == 2  # ncclSystemError
    assert 0.3 <= time.monotonic() - began < 5
    assert controls.peer_timed_out(alone) and not controls.suspended(alone)


def test_a_communicator_without_peers_does_not_wait(fake_nccl_dir):
    lib = NcclLibrary.open(build("suspend", fake_nccl_dir))
    controls = FakeControls(lib.path)
    comm = controls.create(64 * MiB)
    began = time.monotonic()
    lib.comm_suspend(comm)
    lib.comm_resume(comm)
    assert time.monotonic() - began < 1 and not controls.peer_timed_out(comm)
