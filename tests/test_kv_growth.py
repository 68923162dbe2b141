"""KV-cache growth (issue 32): the decision, the concurrency resize and the mid-rollout
regrow, against megatron-core 0.19.2's own code where it runs on a CPU.

From 0.19.2's wheel (tests/test_mcore_0192_sources.py downloads it): the real
``KVBlockAllocator``, the real ``CUDAGraphBatchDimensionBuilder``, and the real bodies
of ``DynamicInferenceEngine.suspend``/``resume`` and of the context's
``deallocate_inference_state_buffers``/``reinitialize_inference_state_buffers``, run
on a stand-in engine and context that hold the state those bodies read (the classes
themselves need CUDA to construct). The agreement of several ranks runs on gloo in
tests/test_adapter_megatron.py.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.util
import sys
import types
from collections import deque

import pytest
import torch

from amem_callbacks.adapters.megatron import concurrency, kv_cache
from amem_callbacks.adapters.megatron.decision import (GrowthDecider, RolloutFigures,
                                                       combine)
from amem_callbacks.adapters.megatron.growth import KvCacheGrowth
from amem_callbacks.adapters.megatron.regrow import regrow
from amem_callbacks.session import Freed
from tests.test_mcore_0192_sources import INFERENCE, mcore, monkeypatch_module, wheel  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MiB = 2**20
GiB = 2**30
#: bound by tests to 0.19.2's builder: concurrency.builder() looks in the context's module
CUDAGraphBatchDimensionBuilder = None


# --- the decision (pure) -----------------------------------------------------------
def figures(tps: float = 100.0, *, grown=False, bound=True, ready=1.0, span=10.0, room=GiB,
            regrow=0.0, resume=0.0) -> RolloutFigures:
    return RolloutFigures(grown=grown, tokens=int(tps * 8), seconds=8.0, span_s=span, steps=100,
                          bound_steps=30 if bound else 0, ready_s=ready, room_bytes=room,
                          regrow_s=regrow, resume_s=resume)


def test_the_first_rollout_runs_at_the_launch_size():
    assert not GrowthDecider().choose().grow


def test_growth_is_probed_only_where_room_was_short():
    decider = GrowthDecider()
    decider.record(figures(bound=False))
    decision = decider.choose()
    assert not decision.grow and "not limited by room" in decision.why
    decider.record(figures(bound=True))
    decision = decider.choose()
    assert decision.grow and decision.probe


@pytest.mark.parametrize("ready,cost,grows", [(1.0, 0.5, True), (9.0, 0.5, True),
                                              (9.0, 1.5, False), (None, 0.0, False)])
def test_a_rollout_too_short_for_the_regrow_is_not_grown(ready, cost, grows):
    decider = GrowthDecider()
    decider.record(figures(ready=ready, span=10.0))
    decision = decider.choose(regrow_cost_s=cost)
    assert decision.grow is grows
    if not grows:
        assert "too short" in decision.why


def test_nothing_freed_means_nothing_to_grow_into():
    decider = GrowthDecider()
    decider.record(figures(room=0))
    assert "nothing to grow into" in decider.choose().why


def run_decider(decider, rates: dict, rollouts: int) -> list:
    """Drive the decider: each rollout runs the chosen arm at ``rates[arm]``."""
    arms = []
    decider.record(figures(rates["skip"]))
    for _ in range(rollouts):
        grow = decider.choose().grow
        arms.append("grow" if grow else "skip")
        decider.record(figures(rates["grow" if grow else "skip"], grown=grow))
    return arms


def test_growth_that_pays_is_kept_and_measured_again_ever_more_rarely():
    arms = run_decider(GrowthDecider(), {"skip": 100.0, "grow": 130.0}, 60)
    assert arms[0] == "grow"  # the probe
    skips = [i for i, arm in enumerate(arms) if arm == "skip"]
    assert len(skips) <= 5, arms  # re-measured rarely: the hold doubles each time
    assert all(b - a > 2 for a, b in zip(skips, skips[1:]))
    assert arms.count("grow") >= 55


def test_growth_that_does_not_pay_costs_at_most_rare_probes():
    arms = run_decider(GrowthDecider(), {"skip": 100.0, "grow": 90.0}, 60)
    assert arms.count("grow") <= 6, arms
    assert arms[-10:] == ["skip"] * 10


@pytest.mark.parametrize("steady,kept", [(115.0, "skip"), (95.0, "grow")])
def test_growth_that_beat_only_the_warm_up_rollout_is_checked_against_the_launch_size_again(
        steady, kept):
    """The first rollout carries the process's warm-up (slow here: 60 tokens/s); growth
    (110) beats it, so the launch size is measured again at once, in its steady state, and
    the better of the two is kept for its hold."""
    decider = GrowthDecider()
    decider.record(figures(60.0))
    arms = []
    for _ in range(4):
        decision = decider.choose()
        arms.append("grow" if decision.grow else "skip")
        decider.record(figures(110.0 if decision.grow else steady, grown=decision.grow))
        if len(arms) == 1:
            assert decision.probe and decider.left == 0
        if len(arms) == 2:
            assert decision.probe and "first rollout's" in decision.why
    assert arms == ["grow", "skip", kept, kept] and decider.winner == kept, arms


def test_a_launch_size_measured_after_the_first_rollout_is_not_measured_again_at_once():
    decider = GrowthDecider()
    decider.record(figures(100.0, bound=False))  # the first: nothing to grow for yet
    assert not decider.choose().grow
    decider.record(figures(100.0))
    assert decider.choose().probe
    decider.record(figures(130.0, grown=True))
    decision = decider.choose()
    assert decision.grow and not decision.probe and decider.left == 2


def test_noise_around_the_threshold_does_not_flip_every_rollout():
    decider = GrowthDecider()
    decider.record(figures(100.0))
    winners, probes = [], 0
    for n in range(80):  # growth gains 3 or 7 %, around the 5 % needed to take it
        decision = decider.choose()
        probes += decision.probe
        decider.record(figures(103.0 + 4.0 * (n % 2) if decision.grow else 100.0,
                               grown=decision.grow))
        if decider.winner != (winners[-1] if winners else None):
            winners.append(decider.winner)
    assert len(winners) <= 3, winners  # the winner settles
    assert probes <= 7  # the other arm is measured again ever more rarely


def test_the_replica_figures_do_not_depend_on_the_order_of_its_ranks():
    a = figures(100.0, ready=2.0)
    b = RolloutFigures(**{**a.__dict__, "seconds": 9.0, "ready_s": 3.0, "bound_steps": 0})
    one, two = combine([a, b]), combine([b, a])
    assert one == two and one.seconds == 9.0 and one.ready_s == 3.0 and one.bound
    assert combine([a, RolloutFigures(**{**a.__dict__, "ready_s": None})]).ready_s is None
    deciders = [GrowthDecider(), GrowthDecider()]
    for decider, order in zip(deciders, ([a, b], [b, a])):
        decider.record(combine(order))
    assert deciders[0].choose() == deciders[1].choose()


def test_figures_travel_through_the_store_as_json():
    f = figures(123.0, grown=True, regrow=0.4)
    assert RolloutFigures.from_json(f.to_json()) == f
    assert f.as_dict()["amem/kv_cache/measured/tokens_per_s"] == pytest.approx(123.0)


def test_the_first_token_is_counted_when_its_step_ends_not_when_it_starts():
    """Measured on Qwen3's preset: the first step began 0.93 s after the request and
    ended 3.4 s after it, behind the suspends; the figure is the later time."""
    from amem_callbacks.adapters.megatron.meter import RolloutMeter

    now = [0.0]
    meter = RolloutMeter(clock=lambda: now[0])
    context = types.SimpleNamespace(total_request_count=4, max_requests=8,
                                    paused_request_count=0)
    engine = types.SimpleNamespace(context=context, waiting_request_ids=[],
                                   evicted_request_count=0)
    for began, ended, ids in ((0.9, 1.0, []), (1.0, 3.4, [1, 2]), (3.4, 3.5, [1, 2])):
        now[0] = began
        meter.step_begins()
        now[0] = ended
        meter.step_ended(engine, {"active_request_ids": ids})
    f = meter.finish(engine, grown=False, ready_at=3.3, resume_s=0.0)
    assert (f.first_step_s, f.first_token_s, f.tokens) == (0.9, 3.4, 4)
    assert f.seconds == pytest.approx(2.6) and f.ready_s == pytest.approx(3.3)


# --- megatron-core 0.19.2's own code, on CPU stand-ins --------------------------------
def _class(tree, name):
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _method(tree, class_name, name):
    return next(n for n in _class(tree, class_name).body
                if isinstance(n, ast.FunctionDef) and n.name == name)


def _context_init_part(init, first: str, count: int) -> str:
    """``count`` statements of the context's ``__init__`` from the one that starts
    with ``first`` (their source as 0.19.2 has it)."""
    body = init.body
    start = next(i for i, node in enumerate(body) if ast.unparse(node).startswith(first))
    return "\n".join(ast.unparse(node) for node in body[start:start + count])


@pytest.fixture(scope="module")
def mc(wheel, mcore, monkeypatch_module):
    """0.19.2's allocator, CUDA-graph builder, engine state, the engine's suspend and
    resume, the context's deallocation and re-allocation, and two parts of the
    context's constructor: the max_requests rule and the CUDA-graph list."""
    kvba, config = mcore
    # batch_dimensions_utils imports two helpers of megatron.core.utils (whose whole
    # module needs 0.19.2's package): those two, from 0.19.2's own utils.py
    utils_src = wheel.read("megatron/core/utils.py").decode()
    utils = types.ModuleType("megatron.core.utils")
    exec("import math\nimport torch\n" + "\n".join(
        ast.get_source_segment(utils_src, n) for n in ast.parse(utils_src).body
        if isinstance(n, ast.FunctionDef) and n.name in ("get_pg_size",
                                                         "round_up_to_nearest_multiple")),
         utils.__dict__)
    path = wheel.extract(f"{INFERENCE}/batch_dimensions_utils.py", path=str(wheel.filename) + ".src")
    with monkeypatch_module.context() as during_import:
        during_import.setitem(sys.modules, "megatron.core.utils", utils)
        spec = importlib.util.spec_from_file_location("mcore_0192_batch_dimensions", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    builder = module.CUDAGraphBatchDimensionBuilder
    monkeypatch_module.setattr(sys.modules[__name__], "CUDAGraphBatchDimensionBuilder", builder)

    engine_tree = ast.parse(wheel.read(f"{INFERENCE}/engines/dynamic_engine.py").decode())
    context_tree = ast.parse(wheel.read(f"{INFERENCE}/contexts/dynamic_context.py").decode())
    calls = {"inference_mode": [], "graphs_deleted": 0}

    class InferenceMode:
        set_active = staticmethod(lambda: calls["inference_mode"].append(True))
        unset_active = staticmethod(lambda: calls["inference_mode"].append(False))

    def delete_cuda_graphs():
        calls["graphs_deleted"] += 1

    namespace = {"KVCacheManagementMode": config.KVCacheManagementMode, "torch": torch,
                 "InferenceMode": InferenceMode, "delete_cuda_graphs": delete_cuda_graphs,
                 "torch_memory_saver": None, "device_memory_summary": lambda: "",
                 "CUDAGraphBatchDimensionBuilder": builder, "math": __import__("math")}
    exec("from enum import Enum, auto\nimport asyncio, logging, time\n"
         + ast.unparse(_class(engine_tree, "EngineState")), namespace)
    for class_name, names in (("DynamicInferenceEngine", ("suspend", "resume", "get_request")),
                              ("DynamicInferenceContext", ("reinitialize_inference_state_buffers",
                                                           "deallocate_inference_state_buffers"))):
        tree = engine_tree if class_name == "DynamicInferenceEngine" else context_tree
        for name in names:
            exec(ast.unparse(_method(tree, class_name, name)), namespace)
    init = _method(context_tree, "DynamicInferenceContext", "__init__")
    rule = next(node for node in ast.walk(init) if isinstance(node, ast.If)
                and ast.unparse(node.test) == "inference_config.max_requests is None")
    exec("def launch_max_requests(self, inference_config, tp_size, mamba_max_requests):\n"
         + "\n".join("    " + line for line in ast.unparse(rule).splitlines()), namespace)
    graphs = _context_init_part(init, "decode_bound =", 3)
    exec("def launch_graph_list(self, inference_config, tp_size):\n"
         + "\n".join("    " + line for line in graphs.splitlines()), namespace)
    constants = {ast.unparse(n.targets[0]): ast.literal_eval(n.value)
                 for n in _class(context_tree, "DynamicInferenceContext").body
                 if isinstance(n, ast.Assign)}
    return types.SimpleNamespace(kvba=kvba, config=config, builder=builder, calls=calls,
                                 constants=constants, **namespace)


class StandInContext:
    """What 0.19.2's context methods and the adapter read of a DynamicInferenceContext,
    set up by 0.19.2's own constructor rules; ``initialize_all_tensors`` stands in for
    the CUDA allocation (CPU tensors of the sizes 0.19.2 gives them) and notes them."""

    def __init__(self, mc, blocks: int, *, tp: int = 1, max_requests=None, hybrid=False,
                 block_bytes: int = 8 * MiB):
        for name, value in mc.constants.items():
            setattr(type(self), name, value)
        for name in ("reinitialize_inference_state_buffers", "deallocate_inference_state_buffers"):
            setattr(type(self), name, getattr(mc, name))
        self.config = types.SimpleNamespace(
            max_requests=max_requests, num_cuda_graphs=16, cuda_graph_max_tokens=512,
            cuda_graph_mixed_prefill_count=16, cuda_graph_all_prefills=False,
            cuda_graph_sizing_distribution=None)
        self.kv_cache_management_mode = mc.config.KVCacheManagementMode.RECOMPUTE
        self.static_kv_memory_pointers, self.unified_memory_level = False, 0
        self._uses_torch_memory_saver, self.is_hybrid_model = False, hybrid
        self.block_size_bytes, self.block_size_tokens = block_bytes, 32
        self.max_tokens, self.max_sequence_length, self.max_kv_block_count = 16384, 64, 2
        self.num_speculative_tokens, self.use_cuda_graphs_for_non_decode_steps = 0, True
        self.total_request_count = self.paused_request_count = 0
        self.chunked_prefill_request_id = -1
        self.kv_block_allocator = mc.kvba.KVBlockAllocator(self, total_count=blocks, paused_count=0)
        mc.launch_max_requests(self, self.config, tp, float("inf"))
        mc.launch_graph_list(self, self.config, tp)
        self.graph_attn_metadata = {"mha_metadata": types.SimpleNamespace(max_blocks=blocks,
                                                                          max_bs=self.max_requests)}
        self.non_graph_attn_metadata = {"mha_metadata": types.SimpleNamespace(
            max_blocks=blocks, max_bs=self.max_requests)}
        self.allocations = []
        self.is_tensor_state_allocated = False
        self.initialize_all_tensors()

    def initialize_all_tensors(self):
        if self.is_tensor_state_allocated:
            return
        self.is_tensor_state_allocated = True
        self.request_ids = torch.full((self.max_requests,), -1, dtype=torch.int32)
        self.memory_buffer = torch.empty((2, 1, self.kv_block_allocator.total_count, 1))
        self.allocations.append((self.kv_block_allocator.total_count, self.max_requests))

    def reset_metadata(self):
        pass


class StandInController:
    """The controller's part the resize touches: its sampling buffers, sized from the
    context's max_requests, and the stop-word callback the engine set."""

    def __init__(self, context):
        self.context = context
        self.vocab_size = 32000
        self.inference_wrapped_model = types.SimpleNamespace(
            config=types.SimpleNamespace(params_dtype=torch.bfloat16))
        self.sized_for = []
        self._init_dynamic_sampling_tensors()
        self._get_stop_word_finished_ids_callback = self.stop_words = lambda ids: set()

    def _init_dynamic_sampling_tensors(self):
        self._get_stop_word_finished_ids_callback = None  # as 0.19.2's does
        self._sampled_tokens = torch.empty(self.context.max_requests, dtype=torch.int64)
        self.sized_for.append(self.context.max_requests)


class Record(list):
    def checkpoint(self):
        self.append(types.SimpleNamespace(**{**vars(self[-1]), "checkpointed": True}))


def request(request_id):
    return types.SimpleNamespace(request_id=request_id, finished_chunk_token_count=0,
                                 prompt_tokens=[1, 2], remaining_prompt_tokens=[1, 2])


def stand_in_engine(mc, context, *, coordinator=True, active=(), waiting=()):
    """A DynamicInferenceEngine as 0.19.2's suspend()/resume() see it, with their
    real bodies; ``_add_request`` and ``create_cuda_graphs`` note what they were given."""

    class Engine:
        suspend = mc.suspend
        resume = mc.resume
        get_request = mc.get_request

        @staticmethod
        @contextlib.contextmanager
        def suspend_resume_ctx(key, *, unified_memory_level):
            yield

        def _add_request(self, req):
            self.waiting_request_ids.append(req.request_id)
            self.added.append(req.request_id)

        def create_cuda_graphs(self):
            dims = self.context.cuda_graph_batch_dimensions_list
            self.captures.append((self.context.kv_block_allocator.total_count,
                                  max(d.prefill_req_count + d.decode_req_count for d in dims)))

        async def _notify_cond_for_new_request(self):
            pass

    engine = Engine()
    engine.context, engine.controller = context, StandInController(context)
    engine.state, engine.use_coordinator = mc.EngineState.RUNNING, coordinator
    engine.unified_memory_level, engine.chunked_prefill_request_id = 0, -1
    engine.requests = {i: types.SimpleNamespace(record=Record([request(i)]))
                       for i in (*active, *waiting)}
    engine.waiting_request_ids, engine.resume_request_ids = deque(waiting), None
    engine._loop, engine.pg_collection, engine.evicted_request_count = (
        asyncio.new_event_loop(), None, 0)
    engine.captures, engine.added = [], []
    return engine


@pytest.fixture
def cpu_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


# --- concurrency follows capacity -------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_requests_for_a_block_count_are_0192s_own_rule(mc, tp):
    for blocks in (10, 97, 182, 259, 1025, 16001):
        context = StandInContext(mc, blocks, tp=tp)  # launch: 0.19.2's rule
        assert concurrency.requests_for(context, blocks, tp) == context.max_requests
    assert StandInContext(mc, 182).max_requests == 180  # the GPU run's launch figure
    # where 0.19.2 would fail its max_tokens assertion, growth stops at max_tokens
    assert concurrency.requests_for(context, 20000, tp) == 16384


def test_growth_raises_max_requests_with_the_blocks_and_pays_for_the_requests(mc):
    engine = stand_in_engine(mc, StandInContext(mc, 182))
    launch = kv_cache.Launch.of(engine)
    assert launch.fixed is None and launch.request_bytes > 0
    extra = 77 * (8 * MiB + launch.request_bytes)
    size = launch.grown_by(engine.context, extra)
    assert size == kv_cache.Size(259, 256)  # x1.43, and the requests follow
    assert launch.bytes_of(size) <= launch.bytes_of(launch.size) + extra
    assert launch.grown_by(engine.context, extra - 1).blocks == 258


def test_a_max_requests_the_user_set_is_kept(mc):
    engine = stand_in_engine(mc, StandInContext(mc, 182, max_requests=64))
    launch = kv_cache.Launch.of(engine)
    assert "--inference-dynamic-batching-max-requests" in launch.fixed
    assert launch.grown_by(engine.context, 77 * 8 * MiB) == kv_cache.Size(259, 64)
    hybrid = kv_cache.Launch.of(stand_in_engine(mc, StandInContext(mc, 182, hybrid=True)))
    assert "Mamba" in hybrid.fixed


def test_the_resize_rebuilds_what_0192s_constructor_sized_from_max_requests(mc):
    context = StandInContext(mc, 182)
    engine = stand_in_engine(mc, context)
    assert max(d.prefill_req_count + d.decode_req_count
               for d in context.cuda_graph_batch_dimensions_list) == 180
    concurrency.resize(engine, 256, 1)
    # the same list 0.19.2's constructor builds for 256 requests
    expected = StandInContext(mc, 259)
    assert expected.max_requests == 256
    assert context.cuda_graph_batch_dimensions_list == expected.cuda_graph_batch_dimensions_list
    assert context.cuda_graph_token_counts == expected.cuda_graph_token_counts
    assert context.graph_attn_metadata["mha_metadata"].max_bs == 256
    controller = engine.controller
    assert controller.sized_for == [180, 256] and controller._sampled_tokens.numel() == 256
    assert controller._get_stop_word_finished_ids_callback is controller.stop_words


def test_the_resize_passes_what_0192s_constructor_passes_to_the_builder(mc, wheel):
    init = _method(ast.parse(wheel.read(f"{INFERENCE}/contexts/dynamic_context.py").decode()),
                   "DynamicInferenceContext", "__init__")
    call = next(n for n in ast.walk(init) if isinstance(n, ast.Call)
                and ast.unparse(n.func).endswith("generate_cuda_graph_batch_dimensions_list"))
    seen = {}

    class Recording:
        @staticmethod
        def generate_cuda_graph_batch_dimensions_list(**kwargs):
            seen.update(kwargs)
            return [], None

    context = StandInContext(mc, 182)
    module = sys.modules[__name__]
    before, module.CUDAGraphBatchDimensionBuilder = module.CUDAGraphBatchDimensionBuilder, Recording
    try:
        concurrency.resize(stand_in_engine(mc, context), 256, 1)
    finally:
        module.CUDAGraphBatchDimensionBuilder = before
    assert set(seen) == {k.arg for k in call.keywords}


def test_0192_sizes_the_controllers_buffers_once_and_clears_the_stop_word_callback(wheel):
    """Why the resize re-runs the controller's sizing and puts the callback back."""
    tree = ast.parse(wheel.read(
        f"{INFERENCE}/text_generation_controllers/text_generation_controller.py").decode())
    sizing = ast.unparse(_method(tree, "TextGenerationController", "_init_dynamic_sampling_tensors"))
    assert "max_requests = context.max_requests" in sizing
    assert "self._get_stop_word_finished_ids_callback = None" in sizing
    init = ast.unparse(_method(tree, "TextGenerationController", "__init__"))
    assert "self._init_dynamic_sampling_tensors()" in init


# --- the regrow between two steps: 0.19.2's suspend() and resume() -----------------------
@pytest.mark.parametrize("coordinator", [True, False])
def test_a_regrow_re_prefills_every_request_in_the_bigger_cache(mc, cpu_sync, coordinator):
    context = StandInContext(mc, 182)
    engine = stand_in_engine(mc, context, coordinator=coordinator, active=(1, 2, 3), waiting=(4,))
    launch = kv_cache.Launch.of(engine)
    size = kv_cache.Size(259, 256)

    seconds = regrow(engine, lambda: kv_cache.apply(engine, launch, size))

    assert seconds >= 0 and engine.state is mc.EngineState.RUNNING  # the loop steps on
    assert context.allocations[-1] == (259, 256)  # 0.19.2's re-allocation saw both
    assert engine.captures == [(259, 256)]  # graphs recaptured for 256 requests
    assert sorted(engine.added) == [1, 2, 3, 4] and sorted(engine.waiting_request_ids) == [1, 2, 3, 4]
    # in-flight requests were checkpointed (prompt + generated so far), waiting ones not
    assert [len(engine.requests[i].record) for i in (1, 2, 3, 4)] == [2, 2, 2, 1]
    assert mc.calls["inference_mode"][-2:] == [False, True]
    assert context.kv_block_allocator.total_count == 259 and context.request_ids.numel() == 256
    engine._loop.run_until_complete(asyncio.sleep(0))


def test_without_the_state_set_aside_0192s_resume_does_nothing_under_the_coordinator(mc, cpu_sync):
    """Why regrow() says 'suspended' for the call: with the coordinator, suspend()
    leaves the state RUNNING and resume() then returns at once."""
    context = StandInContext(mc, 182)
    engine = stand_in_engine(mc, context, active=(1,))
    engine.suspend()
    engine.resume()
    assert not context.is_tensor_state_allocated and engine.captures == []


def test_the_rollout_hooks_ignore_a_regrow(mc, cpu_sync):
    from amem_callbacks.adapters.megatron import hooks

    calls = []

    class Recorder:
        enabled = True

        def __getattr__(self, name):
            return lambda *a, **k: calls.append(name)

    context = StandInContext(mc, 182)
    engine = stand_in_engine(mc, context, active=(1,))
    hooks.set_controller(Recorder())
    try:
        assert hooks.patch_engine(type(engine))
        regrow(engine, lambda: None)
        assert calls == [] and context.is_tensor_state_allocated
        type(engine).suspend(engine)  # a real suspend still ends the rollout
        assert calls == ["rollout_end"]
    finally:
        hooks.remove_hooks()


# --- the whole rollout: start at once, grow when the memory is free, measure, decide -----
class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeSession:
    """All KvCacheGrowth may ask of a RolloutSession: ``freed()``, which never blocks
    (it has no wait: a wait would fail here)."""

    def __init__(self):
        self.state = Freed(0, False)

    def freed(self):
        return self.state


DEMAND = 256  # requests the rollout wants to run at once (each engine's share)


MARGIN = 256 * MiB


def freed_for_77_blocks(engine) -> int:
    """What the suspends must free for 77 more blocks and requests (182 -> 259, x1.43 as
    in the GPU run), the margin on top."""
    return MARGIN + 77 * (8 * MiB + kv_cache.Launch.of(engine).request_bytes)


def run_rollout(growth, engine, session, clock, *, resume=True, steps=40, done_at=5,
                freed=None, demand=DEMAND, step_s=0.05):
    """One rollout on the stand-in engine: resume (0.19.2's own), steps that run as
    many requests as fit (up to ``demand``), the suspends over at step ``done_at``
    (None: before the resume), the engine's suspend. Returns the resume's report."""
    context = engine.context
    freed = freed if freed is not None else engine.freed
    session.state = Freed(freed, True, clock()) if done_at is None else Freed(0, False)
    report = None
    if resume:  # as the coordinator's SUSPEND and RESUME signals drive the engine
        engine.suspend()  # the previous rollout's end
        engine.state = engine.state.SUSPENDED
        report = growth.before_resume(engine, session)
        engine.decided = growth.decision
        engine.resume()
        engine.state = engine.state.RUNNING
    else:
        growth.rollout_started(engine)
    engine.requests = {i: types.SimpleNamespace(record=Record([request(i)])) for i in range(demand)}
    for step in range(steps):
        if step == done_at:
            session.state = Freed(freed, True, clock())
        growth.before_step(engine, session)
        running = min(demand, context.max_requests)
        context.total_request_count = running
        engine.waiting_request_ids = deque(range(running, demand))
        growth.after_step(engine, {"active_request_ids": list(range(running)),
                                   "finished_request_records": []})
        clock.now += step_s
    growth.at_end(engine, session)
    engine.waiting_request_ids, engine.requests = deque(), {}
    return report


@pytest.fixture
def grow(mc, cpu_sync):
    clock = FakeClock()
    growth = KvCacheGrowth(MARGIN, exchange=None, clock=clock)
    engine = stand_in_engine(mc, StandInContext(mc, 182))
    engine.freed = freed_for_77_blocks(engine)
    return growth, engine, FakeSession(), clock


def test_the_rollout_starts_at_once_and_grows_once_the_suspends_are_over(grow):
    growth, engine, session, clock = grow
    context = engine.context
    run_rollout(growth, engine, session, clock, resume=False)  # the launch's rollout
    report = run_rollout(growth, engine, session, clock, done_at=5)
    assert growth.decisions[-1].grow and growth.decisions[-1].probe
    # the resume allocated the launch size at once (nothing waited), then it grew
    assert not report.grown and "grows once they are over" in report.why
    assert context.allocations[-2:] == [(182, 180), (259, 256)]
    grown = growth.reports[-1]
    assert grown.grown and grown.when == "step 6" and grown.max_requests == 256
    assert grown.launch_max_requests == 180 and grown.base_blocks == 182
    assert "256 requests at once (launch: 182 blocks, 180 requests)" in grown.summary()
    assert grown.as_dict()["amem/kv_cache/launch_max_requests"] == 180
    figures = growth.measured[-1]
    assert figures.grown and figures.regrow_s >= 0 and figures.peak_requests == 256
    assert figures.bound  # at the launch size requests waited for room


def test_growth_that_pays_is_kept_and_grows_at_the_resume_when_memory_is_free(grow):
    growth, engine, session, clock = grow
    run_rollout(growth, engine, session, clock, resume=False)
    run_rollout(growth, engine, session, clock, done_at=5)  # the probe
    # the launch size's only figure was the launch's rollout: measured again once
    report = run_rollout(growth, engine, session, clock, done_at=None)
    assert not report.grown and growth.decisions[-1].probe
    assert "measure the launch size again" in growth.decisions[-1].why
    report = run_rollout(growth, engine, session, clock, done_at=None)
    decision = growth.decisions[-1]
    assert decision.grow and not decision.probe and "x1." in decision.why
    assert report.grown and report.when == "resume"  # no regrow needed
    assert engine.context.allocations[-1] == (259, 256)
    assert growth.measured[-1].regrow_s == 0


def test_where_room_never_runs_short_nothing_grows_and_nothing_is_done(grow):
    growth, engine, session, clock = grow
    run_rollout(growth, engine, session, clock, resume=False, demand=100)
    for _ in range(4):
        report = run_rollout(growth, engine, session, clock, demand=100)
        assert not report.grown and "not limited by room" in report.why
    assert {a for a in engine.context.allocations} == {(182, 180)}
    assert not any(r.grown for r in growth.reports) and engine.captures.count((259, 256)) == 0


def test_growth_that_does_not_pay_is_dropped_after_its_probe(grow):
    growth, engine, session, clock = grow
    run_rollout(growth, engine, session, clock, resume=False)
    run_rollout(growth, engine, session, clock, step_s=0.08)  # grown but slower steps
    for _ in range(2):
        run_rollout(growth, engine, session, clock)
        assert not growth.decisions[-1].grow
        assert engine.context.allocations[-1] == (182, 180) and not growth.reports[-1].grown
    run_rollout(growth, engine, session, clock, step_s=0.08)
    assert growth.decisions[-1].probe  # measured again, then held off twice as long
    for _ in range(4):
        run_rollout(growth, engine, session, clock)
        assert not growth.decisions[-1].grow


def test_a_user_set_max_requests_is_kept_while_the_blocks_grow(mc, cpu_sync):
    clock, session = FakeClock(), FakeSession()
    growth = KvCacheGrowth(MARGIN, exchange=None, clock=clock)
    engine = stand_in_engine(mc, StandInContext(mc, 182, max_requests=128))
    engine.freed = freed_for_77_blocks(engine)
    run_rollout(growth, engine, session, clock, resume=False)
    run_rollout(growth, engine, session, clock, done_at=3)
    grown = growth.reports[-1]
    assert grown.grown and grown.blocks > 182 and grown.max_requests == 128
    assert "kept as given" in grown.summary()
    assert engine.controller.sized_for == [128]  # never re-sized


def test_a_builder_with_other_arguments_keeps_max_requests(mc, monkeypatch):
    class Older:  # megatron-core 0.16.1's signature
        @staticmethod
        def generate_cuda_graph_batch_dimensions_list(tp_size, num_cuda_graphs,
                                                      cuda_graph_max_tokens,
                                                      cuda_graph_mixed_prefill_count,
                                                      max_requests, max_tokens,
                                                      max_sequence_length,
                                                      use_cuda_graphs_for_non_decode_steps):
            raise AssertionError("never called")

    engine = stand_in_engine(mc, StandInContext(mc, 182))
    assert concurrency.why_fixed(engine) is None
    monkeypatch.setattr(sys.modules[__name__], "CUDAGraphBatchDimensionBuilder", Older)
    assert "takes other arguments" in concurrency.why_fixed(engine)


class Replica:
    """The store exchange of a two-rank replica, seen from rank 0: the peer reports
    ``peer`` (a dict, or None: it did not come) on every topic."""

    def __init__(self, peer):
        self.peer, self.rounds = peer, []

    def __call__(self, name, value, ranks):
        import json

        self.rounds.append(name.split("/")[1])
        mine = json.loads(value)
        if self.peer is None:
            return {0: value}, [1]
        theirs = dict(mine, **{k: v for k, v in self.peer.items() if k in mine})
        return {0: value, 1: json.dumps(theirs)}, []


@pytest.mark.parametrize("peer,grows", [({"done": True, "freed": None}, True),
                                        ({"done": False}, False), (None, False)])
def test_a_replica_of_two_grows_only_when_both_ranks_are_ready(grow, monkeypatch, peer, grows):
    from amem_callbacks.adapters.megatron import growth as growth_module

    growth, engine, session, clock = grow
    monkeypatch.setattr(growth_module, "replica_ranks", lambda engine: [0, 1])
    if peer is not None and peer.get("freed", 0) is None:
        peer["freed"] = engine.freed - 8 * MiB  # the peer freed one block less
    replica = Replica(dict(peer) if peer else None)
    growth._exchange = replica
    run_rollout(growth, engine, session, clock, resume=False)
    replica.peer = dict(peer) if peer else None
    run_rollout(growth, engine, session, clock, done_at=3)
    polls = replica.rounds.count("ready")
    assert polls == (0 if peer is None else 40 // growth.poll_every if not grows else 1)
    assert any(r.grown for r in growth.reports) is grows
    assert (engine.decided is None) is (peer is None)  # no decision without the peer's figures
    if grows:
        assert growth.reports[-1].blocks == 258 and growth.reports[-1].when == "step 8"


def test_with_expert_parallelism_max_requests_stays_and_nothing_grows_mid_rollout(mc, monkeypatch):
    from amem_callbacks.adapters.megatron import growth as growth_module

    engine = stand_in_engine(mc, StandInContext(mc, 182))
    assert concurrency.why_fixed(engine) is None and growth_module.why_not_mid_rollout(engine) is None
    monkeypatch.setattr(concurrency, "ep_size", lambda engine: 2)
    assert "expert parallelism" in concurrency.why_fixed(engine)
    assert "expert parallelism" in growth_module.why_not_mid_rollout(engine)
