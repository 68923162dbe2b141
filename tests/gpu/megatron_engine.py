"""A megatron-core ``DynamicInferenceEngine`` whose ``resume()``/``suspend()``
run their own bodies without a model: the engine's ``__init__`` needs one (and
CUDA), so :func:`make_engine` fills in only what those two methods read, in
0.16 and in 0.19 alike. Shared by the GPU drivers and the CPU scenarios."""

from __future__ import annotations

import asyncio
from collections import deque


class StubContext:
    """Stands in for DynamicInferenceContext; counts the engine's re-allocations,
    by either release's names: 0.16's resume calls ``allocate_all_tensors``, 0.19's
    ``reinitialize_inference_state_buffers`` (the same for their opposites)."""

    static_kv_memory_pointers = True  # 0.19: no CUDA graphs to delete or capture
    chunked_prefill_request_id = -1

    def __init__(self):
        self.calls = {"allocate": 0, "deallocate": 0, "reset": 0}
        self.kv_cache_management_mode = persist_mode()

    def allocate_all_tensors(self, *, is_init):
        self.calls["allocate"] += 1

    def reinitialize_inference_state_buffers(self):
        self.calls["allocate"] += 1

    def deallocate_all_tensors(self):
        self.calls["deallocate"] += 1

    def deallocate_inference_state_buffers(self):
        self.calls["deallocate"] += 1

    def reset(self):
        self.calls["reset"] += 1


def persist_mode():
    """0.19's KVCacheManagementMode.PERSIST (its suspend keeps the KV tensors), None
    before 0.17 (no such mode)."""
    try:
        from megatron.core.inference.config import KVCacheManagementMode
    except ImportError:
        return None
    return KVCacheManagementMode.PERSIST


def set_engine_state(engine, suspended: bool) -> None:
    """What resume()/suspend() read of the engine's state, in either release: 0.16's
    ``is_suspended`` flag, 0.19's state machine (no coordinator: the engine sets it)."""
    from megatron.core.inference.engines import dynamic_engine

    engine.is_suspended = suspended
    states = getattr(dynamic_engine, "EngineState", None)
    if states is not None:
        engine.state = states.SUSPENDED if suspended else states.RUNNING
        engine.use_coordinator = False


def make_engine(pg_collection=None, suspended: bool = True, cls=None):
    """An engine of ``cls`` (default: the real class) on ``pg_collection`` (default:
    Megatron's own groups), suspended as at launch unless told otherwise."""
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.process_groups_config import ProcessGroupCollection

    engine = object.__new__(cls or DynamicInferenceEngine)
    engine.context = StubContext()
    engine.unified_memory_level = 0
    engine.persist_cuda_graphs = True  # 0.16: no CUDA graphs to delete or capture
    set_engine_state(engine, suspended)
    engine.waiting_request_ids = deque()
    engine.requests = {}
    engine.resume_request_ids = []
    engine._loop = asyncio.new_event_loop()
    engine._cond = asyncio.Condition()
    engine.pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    return engine
