"""Megatron adapter scenarios on gloo: real ``parallel_state`` groups, the real
``DynamicInferenceEngine`` class with the hooks, a fake NCCL behind each group.

Run by tests.harness (``tests.scenarios_megatron:NAME``) in fresh processes.
The engine's own ``__init__`` builds CUDA state (``torch.cuda.Event``), so
:func:`make_engine` fills in only what ``resume()``/``suspend()`` read; their
real bodies run, with ``torch.cuda.synchronize`` and the engine's
memory-logging context (``torch.cuda.memory_stats``) replaced for the CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import textwrap
import types
from collections import deque

import torch
import torch.distributed as dist

from tests.gpu import megatron_engine
from tests.scenarios import FakeNccl, init


class FakeWriter:
    """Records what tensorboard's add_scalar / wandb's log receive."""

    def __init__(self):
        self.scalars, self.logged = [], []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def log(self, metrics, step):
        self.logged.append((dict(metrics), step))


def cpu_engine_class():
    from megatron.core.inference.engines import dynamic_engine
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    if hasattr(dynamic_engine, "delete_cuda_graphs"):
        # 0.19's suspend of a movable cache deletes the graphs, with a gc.collect()
        # (~0.25 s in these processes) that would count as a regrow's cost: no graphs here
        dynamic_engine.delete_cuda_graphs = lambda: None

    class CpuEngine(DynamicInferenceEngine):
        # the engine calls self.__class__.suspend_resume_ctx; the real one reads CUDA stats
        @staticmethod
        @contextlib.contextmanager
        def suspend_resume_ctx(key, *, unified_memory_level):
            yield

        def create_cuda_graphs(self, *args, **kwargs):  # 0.19's resume of a movable cache
            pass

        def get_request(self, request_id):
            """A request the suspend hands to the resume, with what 0.19's recompute
            mode resets (a partly prefilled prompt starts over)."""
            return types.SimpleNamespace(request_id=request_id, remaining_prompt_tokens=[0],
                                         prompt_tokens=[0], finished_chunk_token_count=0)

    return CpuEngine


def make_engine(pg_collection=None, suspended=True, cls=None):
    """The shared stand-in engine (tests/gpu/megatron_engine.py), of the CPU class."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
    return megatron_engine.make_engine(pg_collection, suspended, cls or cpu_engine_class())


def drain(engine):
    """Run what resume() scheduled on the engine's loop (its notify task)."""
    engine._loop.run_until_complete(asyncio.sleep(0))


def exact(group, value: float) -> bool:
    ranks = dist.get_process_group_ranks(group)
    t = torch.full((8,), float(dist.get_rank() + 1) * value)
    dist.all_reduce(t, group=group)
    return bool(torch.all(t == value * sum(r + 1 for r in ranks)))


def init_megatron(args):
    from megatron.core import parallel_state as ps

    init()
    sizes = dict(tensor_model_parallel_size=args.get("tp", 1),
                 pipeline_model_parallel_size=args.get("pp", 1),
                 context_parallel_size=args.get("cp", 1),
                 expert_model_parallel_size=args.get("ep", 1))
    # --create-all-gather-group: 0.16 makes the group in initialize_model_parallel (a
    # global), 0.19 in create_all_gather_groups (kept on the model's collection only)
    own_call = hasattr(ps, "create_all_gather_groups")
    if args.get("ag") and not own_call:
        sizes["create_all_gather_group"] = True
    ps.initialize_model_parallel(**sizes)
    if args.get("ag") and own_call:
        ps.create_all_gather_groups()
    return ps


def controller_for(args, fake, **extra):
    from amem_callbacks.adapters.megatron import Settings, install

    backend = extra.pop("backend", None) or fake.backend()
    settings = Settings(enabled=True, keep=tuple(args.get("keep", ())),
                        backend=args.get("backend_name", "auto"),
                        overlap=not args.get("blocking", False))
    return install(settings=settings, backend=backend, agree_timeout_s=20, timeout_s=30, **extra)


def summary(report) -> dict:
    if report is None:
        return None
    return {"skipped": report.skipped, "summary": report.summary(),
            "groups": {g.name: [g.action, g.reason] for g in report.groups}}


# --- scenarios -----------------------------------------------------------
def describe_groups(controller, ps) -> dict:
    """The roles the adapter found, and the names discovery (so reports) gives them."""
    from amem_callbacks.backends.noop import NoopBackend
    from amem_callbacks.groups import discover

    plan = controller.rollout_groups
    gloo_twins = {id(getattr(ps, n)) for n in dir(ps)
                  if n.endswith("_GLOO") and getattr(ps, n) is not None}
    return {
        "entries": [{"name": e.name, "roles": e.roles, "keep": e.keep, "why": e.why,
                     "ranks": dist.get_process_group_ranks(e.group),
                     "desc": getattr(e.group, "group_desc", None)} for e in plan.entries],
        "discovered_names": sorted(info.name for info in discover(NoopBackend(), plan.groups)),
        "gloo_twins_left_out": not any(id(e.group) in gloo_twins for e in plan.entries),
    }


def engine_cycle(args):
    """The real engine class, hooked: resume() begins the rollout, suspend() ends it."""
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    ps = init_megatron(args)
    fake = FakeNccl()
    tensorboard, wandb = FakeWriter(), FakeWriter()
    controller = controller_for(args, fake, writers=(tensorboard, wandb))
    engine = make_engine()
    hooked = [getattr(getattr(DynamicInferenceEngine, name), "__amem_original__", None)
              for name in ("resume", "suspend")]
    out = {"hooked": [fn is not None for fn in hooked], "cycles": []}
    for cycle in range(args.get("cycles", 2)):
        engine.resume()
        drain(engine)
        controller.policy.wait()  # the begin runs behind the caller (overlap)
        during = fake.suspended()
        kept = [e for e in controller.rollout_groups.entries if e.keep]
        kept_exact = all(exact(e.group, cycle + 2.0) for e in kept)
        still = fake.suspended()  # calls on kept groups must not have resumed anything
        engine.resume()  # running already: the engine returns at once, no second begin
        begins = controller.policy.metrics(last=False)["amem/total/begins"]
        engine.suspend()
        controller.policy.wait()
        after = fake.suspended()
        engine.suspend()  # suspended already: no second end
        all_exact = all(exact(e.group, cycle + 3.0) for e in controller.rollout_groups.entries)
        out["cycles"].append({
            "begin": summary(controller.reports[-2][1]), "end": summary(controller.reports[-1][1]),
            "via": [controller.reports[-2][0], controller.reports[-1][0]],
            "during": during, "still": still, "after": after, "kept_exact": kept_exact,
            "begins_after_second_resume": begins, "all_exact": all_exact})
    out.update(
        mode=controller.rollout_groups.mode, kept=controller.rollout_groups.kept_names,
        counters=controller.policy.metrics(last=False), context_calls=engine.context.calls,
        tensorboard_names=sorted({n for n, _, _ in tensorboard.scalars}),
        tensorboard_steps=sorted({s for _, _, s in tensorboard.scalars}),
        wandb_calls=len(wandb.logged),
        wandb_end=wandb.logged[1][0] if len(wandb.logged) > 1 else None,
        **describe_groups(controller, ps))
    return out


def separate_engine(args):
    """A separate inference model: its own groups stay active, every training group sleeps."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    init_megatron(args)
    world = dist.get_world_size()
    inference_tp = dist.new_group(list(range(world)))
    singles = [dist.new_group([r]) for r in range(world)]
    inference_pp = singles[dist.get_rank()]
    collection = ProcessGroupCollection(tp=inference_tp, pp=inference_pp, mp=inference_tp)
    fake = FakeNccl()
    controller = controller_for(args, fake)
    engine = make_engine(pg_collection=collection)
    engine.resume()
    drain(engine)
    controller.policy.wait()
    during = fake.suspended()
    inference_ok = exact(inference_tp, 2.0)
    engine.suspend()
    controller.policy.wait()
    return {"mode": controller.rollout_groups.mode, "during": during,
            "begin": summary(controller.reports[0][1]), "inference_ok": inference_ok,
            "after": fake.suspended(),
            "all_exact": all(exact(e.group, 4.0) for e in controller.rollout_groups.entries)}


def amem_in_place(args):
    """AMem pauses the whole process: with groups the rollout uses, it must refuse."""
    from amem_callbacks.backends.amem import AmemBackend

    init_megatron(args)
    fake = FakeNccl("amem")
    os.environ.update(NCCL_CUMEM_ENABLE="1", AMEM_ENABLE="1")
    backend = AmemBackend(library=fake.library, handle_of=fake.handle_of)
    controller = controller_for(args, fake, backend=backend)
    engine = make_engine()
    engine.resume()
    drain(engine)
    controller.policy.wait()
    paused = fake.controls.lib.fakeAmemPaused()
    engine.suspend()
    return {"begin": summary(controller.reports[0][1]), "paused_during": paused,
            "all_exact": all(exact(e.group, 2.0) for e in controller.rollout_groups.entries)}


INTERFACE_SOURCE = '''
"""Stand-in for Megatron-LM's megatron/rl/inference/megatron.py (MegatronLocal)."""


class MegatronLocal:
    def __init__(self, engine, drives_engine):
        self._inference_engine = engine
        self.drives_engine = drives_engine
        self.calls = []

    async def resume(self):
        self.calls.append("resume")
        if self.drives_engine:  # 0.17+: RESUME reaches the engine
            self._inference_engine.resume()

    async def suspend(self):
        self.calls.append("suspend")
        if self.drives_engine:  # 0.17+: SUSPEND reaches the engine
            self._inference_engine.suspend()
'''


def interface_seam(args):
    """The RL interface is patched when imported after install; with an interface
    that also drives the engine, each rollout is still one begin and one end."""
    import importlib
    import sys

    root = os.path.join(os.environ["AMEM_TEST_OUT"], f"rank{os.environ['RANK']}-pkg")
    package = os.path.join(root, "megatron", "rl", "inference")
    os.makedirs(package, exist_ok=True)
    for folder in (os.path.join(root, "megatron", "rl"), package):
        open(os.path.join(folder, "__init__.py"), "w").close()
    with open(os.path.join(package, "megatron.py"), "w") as f:
        f.write(textwrap.dedent(INTERFACE_SOURCE))
    init_megatron(args)
    fake = FakeNccl()
    controller = controller_for(args, fake)
    sys.path.insert(0, root)  # megatron is a namespace package: this adds megatron.rl
    module = importlib.import_module("megatron.rl.inference.megatron")
    patched = getattr(module.MegatronLocal.resume, "__amem_original__", None) is not None
    engine = make_engine(suspended=args["drives_engine"])
    interface = module.MegatronLocal(engine, args["drives_engine"])
    loop = asyncio.new_event_loop()
    cycles = []
    for cycle in range(2):
        loop.run_until_complete(interface.resume())
        drain(engine)
        controller.policy.wait()
        during = fake.suspended()
        loop.run_until_complete(interface.suspend())
        controller.policy.wait()
        cycles.append({"during": during, "after": fake.suspended(),
                       "exact": all(exact(e.group, cycle + 2.0) for e in controller.rollout_groups.entries)})
    return {"patched": patched, "cycles": cycles, "via": [v for v, _ in controller.reports],
            "counters": controller.policy.metrics(last=False), "calls": interface.calls,
            "engine_calls": engine.context.calls}


def args_provider(args):
    """No install(): add_args in the parser, the flags in Megatron's global args
    (megatron.training.global_vars, a stand-in here: PyPI megatron-core lacks it),
    metrics to Megatron's global writers at args.curr_iteration."""
    import argparse
    import sys

    from amem_callbacks.adapters.megatron import add_args

    parser = add_args(argparse.ArgumentParser(allow_abbrev=False))
    parsed = parser.parse_args(["--rl-amem-offload-during-rollout", "--rl-amem-backend", "noop",
                                "--rl-amem-keep-groups", "world"])
    parsed.curr_iteration = 7
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars._GLOBAL_ARGS = parsed
    global_vars._GLOBAL_TENSORBOARD_WRITER = FakeWriter()
    init_megatron(args)
    global_vars._GLOBAL_WANDB_WRITER = FakeWriter() if dist.get_rank() == 1 else None
    sys.modules["megatron.training.global_vars"] = global_vars
    from amem_callbacks.adapters.megatron import hooks

    engine = make_engine()
    engine.resume()
    drain(engine)
    engine.suspend()
    controller = hooks.current_controller()
    controller.policy.wait()
    tensorboard, wandb = (global_vars._GLOBAL_TENSORBOARD_WRITER,
                          global_vars._GLOBAL_WANDB_WRITER)
    return {"settings": [controller.settings.backend, list(controller.settings.keep)],
            "reports": [[via, {g.name: g.action for g in r.groups}]
                        for via, r in controller.reports],
            "tensorboard_steps": sorted({s for _, _, s in tensorboard.scalars}),
            "tensorboard_names": len(tensorboard.scalars),
            "wandb_calls": None if wandb is None else len(wandb.logged)}


# --- Megatron-LM's RL loop seam, the deferred parameter gather, the KV growth ---
LOOP_SOURCE = '''
"""Stand-in for Megatron-LM's megatron/rl/rl_utils.py: the shape of
get_environment_rollouts at core_r0.19.0 (launch on the first call, the
interface's resume/suspend around generation, the rollouts' broadcast on the
default group right after)."""
import torch
import torch.distributed as dist

from megatron.rl.inference.megatron import MegatronLocal

_INFERENCE_INTERFACE = None
EVENTS = []


def get_environment_rollouts(model, inference_model, optimizer, n_prompts, samples_per_group):
    global _INFERENCE_INTERFACE
    import asyncio

    loop = asyncio.new_event_loop()
    if _INFERENCE_INTERFACE is None:  # launch: broadcasts on dp as the real one does
        from megatron.core import parallel_state as ps

        box = [f"tcp://coordinator-{dist.get_rank()}"]
        dist.broadcast_object_list(box, src=dist.get_process_group_ranks(
            ps.get_data_parallel_group())[0], group=ps.get_data_parallel_group())
        EVENTS.append("launch")
        _INFERENCE_INTERFACE = MegatronLocal(ENGINE)
    loop.run_until_complete(_INFERENCE_INTERFACE.resume())
    EVENTS.append("generate")
    model[0](torch.ones(4))  # the rollout's first forward: pre-hooks may gather
    loop.run_until_complete(_INFERENCE_INTERFACE.suspend())
    rollouts = [[f"rollout-{dist.get_rank()}"]]
    dist.broadcast_object_list(rollouts, src=0)  # at once after the rollout, on world
    EVENTS.append("broadcast")
    return rollouts
'''

INTERFACE_DRIVING_SOURCE = '''
class MegatronLocal:
    def __init__(self, engine):
        self._inference_engine = engine

    async def resume(self):
        self._inference_engine.resume()

    async def suspend(self):
        self._inference_engine.suspend()
'''

DDP_SOURCE = '''
"""Stand-in for megatron.core.distributed.DistributedDataParallel's parameter
gather with --overlap-param-gather: the optimizer step leaves the gather to
forward pre-hooks, which issue it through the name megatron-core binds at
import (dist_all_gather_func) inside an async coalescing manager, on the
distributed-optimizer group, as _ParamAndGradBucketGroup.start_param_sync does."""
import torch
import torch.distributed as dist
from megatron.core.distributed.param_and_grad_buffer import dist_all_gather_func

GATHERS = []


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.group = group
        self.use_forward_hook = True
        self.remove_forward_pre_hook_handles = {}
        self.param_gather_dispatched = True
        self.enable_forward_pre_hook()

    def forward(self, x):
        return self.inner(x)

    def optimizer_step(self):
        self.param_gather_dispatched = False  # the next forward gathers

    def enable_forward_pre_hook(self):
        assert not self.remove_forward_pre_hook_handles
        for module in self.modules():
            self.remove_forward_pre_hook_handles[module] = module.register_forward_pre_hook(
                lambda *unused: self.start_param_sync())

    def disable_forward_pre_hook(self, param_sync=True):
        for handle in self.remove_forward_pre_hook_handles.values():
            handle.remove()
        self.remove_forward_pre_hook_handles = {}
        if param_sync:
            self.start_param_sync(force_sync=True)

    def start_param_sync(self, force_sync=False):
        if self.param_gather_dispatched and not force_sync:
            return
        shard = torch.full((4,), float(dist.get_rank() + 1))
        out = torch.empty(4 * dist.get_world_size(group=self.group))
        with dist._coalescing_manager(self.group, async_ops=True) as cm:
            dist_all_gather_func(out, shard, group=self.group, async_op=True)
        cm.wait()
        GATHERS.append(out.tolist())
        self.param_gather_dispatched = True
'''


class StagingOptimizer:
    """Megatron's optimizer as the adapter sees it: staging before a forced gather."""

    def __init__(self):
        self.staged = 0

    def prepare_model_params_for_param_sync(self):
        self.staged += 1


def _stand_in_megatron_lm(name: str, files: dict) -> None:
    """Write stand-in Megatron-LM modules (megatron is a namespace package, so they
    join the installed megatron-core) and put them on sys.path."""
    import sys

    root = os.path.join(os.environ["AMEM_TEST_OUT"], f"rank{os.environ['RANK']}-{name}")
    for relative, source in files.items():
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for folder in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
            init_file = os.path.join(folder, "__init__.py")
            if folder.endswith(("rl", "inference")) and not os.path.exists(init_file):
                open(init_file, "w").close()
        with open(path, "w") as f:
            f.write(textwrap.dedent(source))
    sys.path.insert(0, root)


def loop_seam(args):
    """Megatron-LM's loop with --overlap-param-gather: the gather the rollout's
    first forward would issue on the distributed-optimizer group happens before
    the begin, the first rollout begins after the launch, later ones as soon as
    rollouts are asked for, and nothing reaches a suspended group."""
    import importlib

    from megatron.core import parallel_state as ps

    _stand_in_megatron_lm("loop", {"megatron/rl/rl_utils.py": LOOP_SOURCE,
                                   "megatron/rl/inference/megatron.py": INTERFACE_DRIVING_SOURCE,
                                   "megatron/rl/standin_ddp.py": DDP_SOURCE})
    init_megatron(args)
    fake = FakeNccl()
    controller = controller_for(args, fake)
    if args.get("skip_param_sync"):  # mutation: the adapter forgets the deferred gather
        from amem_callbacks.adapters.megatron import param_sync

        param_sync.finish_before_suspend = lambda *a, **k: []
    if args.get("no_guard"):  # mutation: the guard lets every call through
        from amem_callbacks.guard_owner import GuardOwner

        GuardOwner.before_use = lambda *a, **k: None
    rl_utils = importlib.import_module("megatron.rl.rl_utils")
    ddp_module = importlib.import_module("megatron.rl.standin_ddp")
    rl_utils.ENGINE = make_engine()
    chunk = ddp_module.DistributedDataParallel(ps.get_data_parallel_group(with_context_parallel=True))
    optimizer = StagingOptimizer()
    events, rounds = rl_utils.EVENTS, []
    for iteration in range(args.get("rollouts", 3)):
        chunk.optimizer_step()  # training leaves the next gather to the pre-hooks
        gathers_before = len(ddp_module.GATHERS)
        rl_utils.get_environment_rollouts([chunk], None, optimizer, 2, 2)
        controller.policy.wait()
        rounds.append({"via": [via for via, _ in controller.reports[-2:]],
                       "gathered": len(ddp_module.GATHERS) - gathers_before,
                       "hooks_on_after": bool(chunk.remove_forward_pre_hook_handles),
                       "suspended_after": fake.suspended()})
    counters = controller.policy.metrics(last=False)
    return {"events": events, "rounds": rounds, "staged": optimizer.staged,
            "gathers_exact": all(g == [1.0] * 4 + [2.0] * 4 for g in ddp_module.GATHERS),
            "guard_resumes": counters["amem/total/auto_resumes"],
            "begins": counters["amem/total/begins"],
            "all_exact": all(exact(e.group, 5.0) for e in controller.rollout_groups.entries)}


class GrowableContext:
    """What the engine's resume/suspend and the KV growth read of a megatron-core 0.19
    DynamicInferenceContext (0.19.2's own code runs in tests/test_kv_growth.py); the
    0.16.1 engine's resume calls ``allocate_all_tensors``, which notes the size."""

    REQUEST_ROUNDER = 4  # 0.19.2's (test_kv_growth checks the rule against its source)
    static_kv_memory_pointers = False  # the KV cache may move: it can grow
    chunked_prefill_request_id = -1

    def __init__(self, allocator_class, mode, blocks: int):
        self.kv_block_allocator = allocator_class(self, blocks, 0)
        self.kv_cache_management_mode = mode
        self.block_size_bytes, self.block_size_tokens = 8 * MiB, 32
        self.max_requests = (blocks - 1) // self.REQUEST_ROUNDER * self.REQUEST_ROUNDER
        self.max_tokens, self.max_sequence_length, self.max_kv_block_count = 16384, 64, 2
        self.use_cuda_graphs_for_non_decode_steps = True
        self.config = type("Config", (), dict(
            max_requests=None, num_cuda_graphs=None, cuda_graph_max_tokens=512,
            cuda_graph_mixed_prefill_count=16, cuda_graph_all_prefills=False))()
        self.total_request_count = self.paused_request_count = 0
        self.allocations = []

    def allocate_all_tensors(self, *, is_init):
        self.allocations.append([self.kv_block_allocator.total_count, self.max_requests])

    def reinitialize_inference_state_buffers(self):  # 0.19's engine resume
        self.allocate_all_tensors(is_init=False)

    def deallocate_all_tensors(self):
        pass

    def deallocate_inference_state_buffers(self):  # 0.19's engine suspend
        self.deallocate_all_tensors()

    def reset(self):
        pass


class CUDAGraphBatchDimensionBuilder:
    """Stands in for 0.19's builder (its real one runs in tests/test_kv_growth.py):
    one decode graph per request count up to max_requests."""

    @staticmethod
    def generate_cuda_graph_batch_dimensions_list(*, tp_size, num_cuda_graphs,
                                                   cuda_graph_max_tokens,
                                                   cuda_graph_mixed_prefill_request_count,
                                                   max_requests, max_tokens, max_sequence_length,
                                                   use_cuda_graphs_for_non_decode_steps,
                                                   num_speculative_tokens, sizing_distribution):
        return [max_requests], None


class SamplingController:
    """The controller's sampling buffers, sized from the context's max_requests."""

    vocab_size = 1000

    def __init__(self, context):
        self.context, self.sized_for = context, []

    def _init_dynamic_sampling_tensors(self):
        self.sized_for.append(self.context.max_requests)


ALLOCATOR = '''
import enum


class KVCacheManagementMode(str, enum.Enum):
    PERSIST = "persist"
    RECOMPUTE = "recompute"


class KVBlockAllocator:
    """megatron-core 0.19's constructor; the engine's resume reads total_count."""

    def __init__(self, context, total_count, paused_count, enable_prefix_caching=False,
                 prefix_caching_eviction_policy=None):
        self.context, self.total_count, self.paused_count = context, total_count, paused_count
        self.total_avail = total_count - 1
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_caching_eviction_policy = prefix_caching_eviction_policy
'''


def kv_growth(args):
    """--rl-amem-grow-kv-cache on one model replica of two ranks (TP 2): each rollout
    starts at once on the launch-size cache; once both ranks' suspends are over, both
    grow at the same engine step by the smaller of their freed bytes, less the margin,
    with max_requests following; both reach the same decisions. Persist mode says once
    that nothing can grow. Steps go through the hooked ``async_step``."""
    import time

    from megatron.core.inference.engines import dynamic_engine

    from amem_callbacks.adapters.megatron import Settings, install

    namespace = {}
    exec(textwrap.dedent(ALLOCATOR), namespace)
    demand = args.get("demand", 256)

    async def step(self):  # stands in for the engine's step: as many requests as fit run
        running = min(demand, self.context.max_requests)
        self.context.total_request_count = running
        self.waiting_request_ids = deque(range(demand - running))
        time.sleep(args.get("step_s", 0.005))
        return {"active_request_ids": list(range(running)), "finished_request_records": []}

    dynamic_engine.DynamicInferenceEngine.async_step = step  # the hooks wrap this one

    class Engine(cpu_engine_class()):  # the requests a suspend hands to the resume
        def _add_request(self, request):
            self.waiting_request_ids.append(request.request_id)

    init_megatron(args)
    # the ranks free different amounts: the agreement takes the smaller
    fake = FakeNccl(default_mib=480 if dist.get_rank() == 0 else 384)
    settings = Settings(enabled=True, grow_kv_cache=True, kv_margin_gb=args["margin_gb"])
    controller = install(settings=settings, backend=fake.backend(), agree_timeout_s=20,
                         timeout_s=30)
    engine = make_engine(cls=Engine)
    engine.context = GrowableContext(namespace["KVBlockAllocator"],
                                     namespace["KVCacheManagementMode"](args["mode"]), 100)
    engine.controller = SamplingController(engine.context)
    out = {"rollouts": []}
    for rollout in range(args.get("rollouts", 3)):
        engine.resume()
        drain(engine)
        resumed = controller.session.freed()  # what the resume left running
        # held until the first step with tokens has ended (HOLD_UNTIL_FIRST_TOKEN_S)
        time.sleep(0.2)
        held_at_resume = not any(fake.suspended().values())
        engine._loop.run_until_complete(engine.async_step())
        stepped = time.monotonic()  # then the suspends start: seconds until one is
        while not any(fake.suspended().values()) and time.monotonic() - stepped < 10:
            time.sleep(0.005)
        started_after_first_step_s = time.monotonic() - stepped
        # On a busy CPU the suspends may outlast the steps: step until grown, then at
        # least as many steps again, so the grown part is never a sliver of the rollout
        # (else its measured rate could lose to the launch size's by chance, as on CI).
        steps = waited = 0
        while steps < 5000 and (steps < args.get("steps", 120) or controller.growth.waiting
                                or steps < 2 * waited):
            if controller.growth.waiting:
                waited = steps + 1
            engine._loop.run_until_complete(engine.async_step())
            steps += 1
        engine.waiting_request_ids.clear()  # every request done: the rollout is over
        engine.suspend()
        controller.policy.wait()
        if rollout == 0 and args.get("slow_suspends_ms"):  # later begins outlast the resume
            for comm in fake.comms.values():
                fake.controls.delay(comm, args["slow_suspends_ms"] * 1000)
        out["rollouts"].append({
            "suspends_done_at_resume": resumed.done,
            "held_at_resume": held_at_resume,
            "started_after_first_step_s": started_after_first_step_s,
            "held_seconds": controller.last_begin.held_seconds,
            "reports": [dict(r.as_dict(), when=r.when, summary=r.summary())
                        for r in controller.kv_reports if r is not None][-2:],
            "decision": controller.growth.decisions[-1].why if controller.growth.decisions
            else None,
            "measured": controller.growth.measured[-1].as_dict() if controller.growth.measured
            else None})
        controller.kv_reports.clear()
    out["allocations"] = engine.context.allocations
    out["sized_for"] = engine.controller.sized_for
    out["freed_bytes"] = controller.reports[0][1].nccl_bytes
    return out


MiB = 2**20
