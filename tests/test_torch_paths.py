"""Which way the nccl backend reaches a group's communicator on each torch, and
that the default way never holds the GIL (stand-ins shaped like torch 2.11-2.15)."""

import threading
import time

import pytest

from amem_callbacks.backends.nccl import CommunicatorGone, NcclBackend, handle_for
from amem_callbacks.backends.torch_comms import Path, how_to_reach
from amem_callbacks.nccl_library import NcclLibrary
from tests import torch_standins
from tests.fake_nccl import FakeControls, build
from tests.harness import run_ranks

MiB = 2**20


@pytest.fixture
def fake(fake_nccl_dir):
    path = build("suspend", fake_nccl_dir)
    return path, NcclLibrary.open(path), FakeControls(path)


@pytest.mark.parametrize("shape, path", [
    ("2.11", Path.CTYPES),
    ("2.12-2.14", Path.CTYPES),  # torch has suspend() too, but it holds the GIL
    ("2.14-nccl2", Path.TORCH),  # no pointer: torch's own methods are the only way
    ("2.15-nccl2", Path.CTYPES),
    ("2.15-nccl-lazy", Path.CTYPES),
    ("2.15-nccl-legacy", Path.CTYPES),
])
def test_each_torch_shape_takes_the_expected_path(fake, shape, path):
    lib_path, _lib, controls = fake
    backend = torch_standins.make(shape, lib_path, controls.create(100 * MiB))
    handle, why = handle_for(backend)
    assert why is None and handle.path is path, handle.why
    assert handle.holds_gil == (path is Path.TORCH)


def test_path_preference_and_what_is_not_an_nccl_group(fake):
    lib_path, _lib, controls = fake
    comm = controls.create(100 * MiB)
    native = how_to_reach(torch_standins.make("2.12-2.14", lib_path, comm), "torch")
    assert native.path is Path.TORCH
    refused = how_to_reach(torch_standins.make("2.14-nccl2", lib_path, comm), "ctypes")
    assert refused.path is None and "forbids" in refused.why
    gloo = how_to_reach(torch_standins.ProcessGroupGloo())
    assert gloo.path is None and gloo.why.startswith("not an NCCL group")
    wrapped = torch_standins._ProcessGroupWrapper(torch_standins.make("2.15-nccl2", lib_path, comm))
    assert handle_for(wrapped)[0].path is Path.CTYPES  # TORCH_DISTRIBUTED_DEBUG=DETAIL
    with pytest.raises(ValueError, match="write one of 'auto', 'ctypes', 'torch'"):
        NcclBackend(path="gil")


def test_ctypes_path_never_calls_torchs_suspend(fake):
    lib_path, lib, controls = fake
    comm = controls.create(100 * MiB)
    torch_backend = torch_standins.make("2.12-2.14", lib_path, comm)
    backend = NcclBackend(library=lib)
    handle, _ = handle_for(torch_backend)
    backend.suspend(handle)
    assert controls.suspended(comm) and backend.memory(handle).suspended
    backend.resume(handle)
    assert not controls.suspended(comm) and torch_backend.calls == []


def test_a_comm_not_created_yet_is_kept_with_the_reason(fake):
    lib_path, _lib, _controls = fake
    handle, why = handle_for(torch_standins.make("2.15-nccl2", lib_path, 0))
    assert handle is None and "not created yet" in why


def test_the_pointer_is_read_again_before_each_call(fake):
    lib_path, lib, controls = fake
    comm = controls.create(100 * MiB)
    torch_backend = torch_standins.make("2.15-nccl2", lib_path, comm)
    backend = NcclBackend(library=lib)
    handle, _ = handle_for(torch_backend)
    torch_backend.ptr = 0  # destroyed or aborted after discovery
    with pytest.raises(CommunicatorGone, match="suspend: the group has no communicator"):
        backend.suspend(handle)
    torch_backend.ptr = comm
    backend.suspend(handle)
    torch_backend.ptr = controls.create(100 * MiB)  # re-created while suspended
    with pytest.raises(CommunicatorGone, match="replaced since it was suspended"):
        backend.resume(handle)
    assert controls.suspended(comm)  # nothing was called on the wrong communicator


def test_nccl_lazy_reports_the_pair_communicators_it_cannot_reach(fake):
    lib_path, lib, controls = fake
    primary = controls.create(100 * MiB, 4 * MiB)
    pairs = [controls.create(30 * MiB, 2 * MiB), controls.create(30 * MiB, 2 * MiB)]
    handle, _ = handle_for(torch_standins.make("2.15-nccl-lazy", lib_path, primary, pairs))
    memory = NcclBackend(library=lib).memory(handle)
    assert memory.suspendable == 100 * MiB and memory.unreached_bytes == 64 * MiB
    assert "per-peer" in memory.unreached_why
    # path="torch" reaches them all (at the GIL's price)
    native, _ = handle_for(torch_standins.make("2.15-nccl-lazy", lib_path, primary, pairs), "torch")
    assert NcclBackend(library=lib).memory(native).suspendable == 160 * MiB


def _suspend_in_thread_and_try_to_run_python(backend, handle, controls, comm):
    """A thread suspends ``comm``; this thread must get to run Python (and open
    the fake's gate) while the suspend is inside NCCL. If the call holds the
    GIL, this thread cannot run, the fake's wait runs out, and it says so."""
    controls.set_gate(comm)
    thread = threading.Thread(target=backend.suspend, args=(handle,))
    thread.start()
    ran_during = 0
    deadline = time.monotonic() + 30
    while not controls.in_suspend(comm) and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.001)
    while controls.in_suspend(comm) and ran_during < 1000:
        ran_during += 1  # pure Python: only possible while the GIL is free
    controls.open_gate(comm)
    thread.join()
    return ran_during, controls.gate_timed_out(comm)


@pytest.mark.parametrize("shape", ["2.11", "2.12-2.14", "2.15-nccl2"])
def test_gil_is_released_during_a_suspend_on_the_default_path(fake, shape):
    lib_path, lib, controls = fake
    comm = controls.create(100 * MiB)
    handle, _ = handle_for(torch_standins.make(shape, lib_path, comm))
    ran, timed_out = _suspend_in_thread_and_try_to_run_python(
        NcclBackend(library=lib), handle, controls, comm)
    assert not timed_out and ran > 0


def test_gil_probe_catches_a_gil_holding_suspend(fake):
    """The probe itself can fail: torch's own method (forced with path='torch')
    keeps the GIL, and the fake's wait runs out."""
    lib_path, lib, controls = fake
    comm = controls.create(100 * MiB)
    handle, _ = handle_for(torch_standins.make("2.12-2.14", lib_path, comm), "torch")
    ran, timed_out = _suspend_in_thread_and_try_to_run_python(
        NcclBackend(library=lib), handle, controls, comm)
    assert timed_out and ran == 0


def test_gil_caller_keeps_running_during_an_overlapped_begin_on_every_rank():
    results = run_ranks("gil_overlapped_begin", world=2, timeout=120,
                        args={"shape": "2.12-2.14", "groups": 3})
    for r in results:
        assert r["result"]["gate_timed_out"] == [False, False, False], r["result"]
        assert r["result"]["ran_during_suspend"] > 0 and r["result"]["begin_pending"], r["result"]
        assert r["result"]["paths"] == ["ctypes"] * 4 and r["result"]["exact_after"]  # + world


def test_gil_holding_groups_run_serially_and_begin_waits_for_them():
    results = run_ranks("gil_overlapped_begin", world=2, timeout=120,
                        args={"shape": "2.14-nccl2", "groups": 3, "gate": False})
    for r in results:
        res = r["result"]
        assert not res["begin_pending"] and res["gil_held"], res
        assert res["paths"] == ["torch-native"] * 4 and res["exact_after"]
        assert res["gil_warnings"] == 1, r["log"]
