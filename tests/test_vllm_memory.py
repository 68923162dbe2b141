"""adapters/_vllm_memory.py: what a colocated vLLM maps at its KV wake-up, read from
a stand-in of vLLM's CuMemAllocator singleton (the layout of vLLM 0.31's cumem.py)."""

import sys
import types

import pytest

from amem_callbacks.adapters import _vllm_memory as vm

MIB = 2**20


def allocator(monkeypatch, rows):
    module = types.ModuleType(vm._CUMEM)
    table = {i: types.SimpleNamespace(handle=(0, size, i, 0), tag=tag, **extra)
             for i, (tag, size, extra) in enumerate(rows)}
    module.CuMemAllocator = types.SimpleNamespace(
        instance=types.SimpleNamespace(pointer_to_data=table))
    monkeypatch.setitem(sys.modules, vm._CUMEM, module)


def test_nothing_is_known_without_vllms_allocator(monkeypatch):
    monkeypatch.delitem(sys.modules, vm._CUMEM, raising=False)
    assert vm.wake_bytes(["kv_cache"]) is None and vm.awake_bytes() is None
    assert vm.upcoming_bytes(["kv_cache"], None, None) is None
    module = types.ModuleType(vm._CUMEM)  # loaded, no instance yet (engine not built)
    module.CuMemAllocator = types.SimpleNamespace(instance=None)
    monkeypatch.setitem(sys.modules, vm._CUMEM, module)
    assert vm.wake_bytes(None) is None


def test_the_wake_up_maps_the_sleeping_allocations_of_its_tags(monkeypatch):
    allocator(monkeypatch, [("weights", 300 * MIB, {"is_asleep": False}),
                            ("kv_cache", 200 * MIB, {"is_asleep": True}),
                            ("kv_cache", 50 * MIB, {"is_asleep": True}),
                            ("weights", 10 * MIB, {"is_asleep": True})])
    assert vm.wake_bytes(["kv_cache"]) == 250 * MIB
    assert vm.wake_bytes(None) == 260 * MIB
    assert vm.wake_bytes(["other"]) is None  # nothing of that tag asleep: unknown
    assert vm.awake_bytes() == 300 * MIB


def test_before_is_asleep_every_kept_allocation_sleeps(monkeypatch):
    allocator(monkeypatch, [("weights", 300 * MIB, {}), ("kv_cache", 200 * MIB, {})])
    assert vm.wake_bytes(["kv_cache"]) == 200 * MIB and vm.awake_bytes() is None
    # what is mapped is then unknown: the whole budget counts as coming (more waiting)
    assert vm.upcoming_bytes(["kv_cache"], 0.01, 80 * 2**30) == int(0.01 * 80 * 2**30)


def test_what_comes_is_the_kv_cache_or_the_rest_of_vllms_budget_whichever_is_larger(
        monkeypatch):
    allocator(monkeypatch, [("weights", 300 * MIB, {"is_asleep": False}),
                            ("kv_cache", 200 * MIB, {"is_asleep": True})])
    gib = 2**30
    # share 0.01 of 80 GiB = 819.2 MiB, less the 300 MiB of weights mapped: 519.2 MiB
    assert vm.upcoming_bytes(["kv_cache"], 0.01, 80 * gib) == int(0.01 * 80 * gib) - 300 * MIB
    assert vm.upcoming_bytes(["kv_cache"], 0.001, 80 * gib) == 200 * MIB  # the cache is larger
    assert vm.upcoming_bytes(["kv_cache"], None, None) == 200 * MIB


def test_a_layout_it_does_not_know_reads_as_unknown(monkeypatch):
    module = types.ModuleType(vm._CUMEM)
    module.CuMemAllocator = types.SimpleNamespace(instance=types.SimpleNamespace(
        pointer_to_data={1: types.SimpleNamespace(handle=None, tag="kv_cache")}))
    monkeypatch.setitem(sys.modules, vm._CUMEM, module)
    assert vm.wake_bytes(["kv_cache"]) is None and vm.awake_bytes() is None


@pytest.mark.parametrize("share", [0.3, None])
def test_reading_never_imports_vllm(monkeypatch, share):
    monkeypatch.delitem(sys.modules, vm._CUMEM, raising=False)
    vm.upcoming_bytes(None, share, 80 * 2**30)
    assert vm._CUMEM not in sys.modules


def test_a_measured_generation_replaces_the_rest_of_vllms_budget(monkeypatch):
    """Once a generation measured what it took beyond its KV wake-up, what comes is
    the cache plus that: the rest-of-budget rule counts what stays allocated through
    sleep (CUDA graphs) too, and on one H100 made a begin wait for nothing."""
    allocator(monkeypatch, [("weights", 300 * MIB, {"is_asleep": False}),
                            ("kv_cache", 200 * MIB, {"is_asleep": True})])
    gib = 2**30
    assert vm.upcoming_bytes(["kv_cache"], 0.01, 80 * gib, generation_bytes=64 * MIB) \
        == 264 * MIB
    assert vm.upcoming_bytes(["kv_cache"], 0.01, 80 * gib, generation_bytes=-5) == 200 * MIB
    # the cache itself unknown: the measured figure alone is not an estimate
    monkeypatch.delitem(sys.modules, vm._CUMEM)
    assert vm.upcoming_bytes(["kv_cache"], 0.01, 80 * gib, generation_bytes=64 * MIB) \
        == int(0.01 * 80 * gib)


@pytest.mark.parametrize("error, short", [
    (RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),  # torch's text
    (MemoryError("out of memory"), False),  # the host's: a suspend would need host memory
    (RuntimeError("CUDA Error: invalid argument at /workspace/csrc/cumem_allocator.cpp:258"),
     False),
    (ValueError("out of memory"), False),  # not an allocation's error type
])
def test_only_an_allocation_that_found_too_little_memory_counts_as_short(error, short):
    assert vm.is_out_of_memory(error) is short
