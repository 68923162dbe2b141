"""Every name the collective-path audit (docs/design.md, "Which path each
collective takes") relies on still exists in the installed torch, megatron-core,
trl, accelerate and verl. A release that moves one fails here, naming it, before
a job meets a suspended communicator through a path nobody covers."""

import importlib

import pytest

#: (module, attribute path, why the package relies on it)
TORCH = [
    ("torch.distributed.distributed_c10d", "_coalescing_manager",
     "Megatron's bucket collectives; its fast path ends in a *_coalesced method"),
    ("torch.distributed.distributed_c10d", "new_group", "creation may split the default comm"),
    ("torch.distributed.distributed_c10d", "destroy_process_group", "the guard forgets the group"),
    ("torch.distributed.distributed_c10d", "batch_isend_irecv", "pipeline p2p"),
]
#: the ProcessGroup methods torch's own functions call; where torch renamed one,
#: the alternatives (torch 2.13 name first, the 2.11 one after)
PROCESS_GROUP_METHODS = [
    ("allreduce",), ("allreduce_coalesced",), ("allgather",), ("allgather_coalesced",),
    ("all_gather_single", "_allgather_base"),
    ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
    ("reduce_scatter",), ("reduce_scatter_single", "_reduce_scatter_base"),
    ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
    ("all_to_all_single", "alltoall_base"), ("alltoall",), ("broadcast",), ("reduce",),
    ("gather",), ("scatter",), ("barrier",), ("send",), ("recv",), ("recv_anysource",)]
MEGATRON_CORE = [
    ("megatron.core.distributed.param_and_grad_buffer", "dist_all_gather_func",
     "the distributed optimizer's param gather, bound at import"),
    ("megatron.core.distributed.param_and_grad_buffer", "dist_reduce_scatter_func",
     "the grad reduce-scatter, bound at import"),
    ("megatron.core.distributed.distributed_data_parallel",
     "DistributedDataParallel.disable_forward_pre_hook",
     "the adapter finishes the deferred param gather with it before a suspend"),
    ("megatron.core.distributed.distributed_data_parallel",
     "DistributedDataParallel.enable_forward_pre_hook", "and turns the hooks back on after"),
    ("megatron.core.distributed.distributed_data_parallel",
     "DistributedDataParallel.start_param_sync", "what disable_forward_pre_hook(param_sync) runs"),
    ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func",
     "TP/SP gathers, bound at import (tp is kept during in-place inference)"),
    ("megatron.core.inference.engines.dynamic_engine", "DynamicInferenceEngine.resume",
     "begin seam; the KV cache is re-allocated here"),
    ("megatron.core.inference.engines.dynamic_engine", "DynamicInferenceEngine.suspend",
     "end seam; the KV cache is freed here"),
    ("megatron.core.inference.engines.dynamic_engine",
     "DynamicInferenceEngine.start_listening_to_data_parallel_coordinator",
     "the launch's broadcasts on dp and world (why rollout 1 begins after it)"),
    ("megatron.core.process_groups_config", "ProcessGroupCollection", "the engine's groups"),
    ("megatron.core.parallel_state", "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
     "a group the rollout suspends"),
    ("megatron.core.parallel_state", "_DATA_PARALLEL_GROUP_WITH_CP", "a group the rollout suspends"),
]
#: 0.17+ only: the KV cache growth (checked where that megatron-core is installed)
MEGATRON_CORE_GROWTH = [
    ("megatron.core.inference.contexts.kv_block_allocator", "KVBlockAllocator.__init__",
     "a bigger block pool for the next re-allocation"),
    ("megatron.core.inference.contexts.dynamic_context",
     "DynamicInferenceContext.reinitialize_inference_state_buffers",
     "recompute mode re-allocates from kv_block_allocator.total_count"),
    ("megatron.core.inference.config", "KVCacheManagementMode.RECOMPUTE", "growable mode"),
]
#: Megatron-LM, not on PyPI: checked where it is importable (the GPU bundle)
MEGATRON_LM = [
    ("megatron.rl.rl_utils", "get_environment_rollouts", "early-begin seam (called by name)"),
    ("megatron.rl.rl_utils", "_INFERENCE_INTERFACE", "whether the engine was launched"),
    ("megatron.rl.inference.megatron", "MegatronLocal.resume", "begin seam of rollout 1"),
    ("megatron.rl.inference.megatron", "MegatronLocal.suspend", "end seam (0.16)"),
]
VERL = [
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights", "suspend seam"),
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.compute_log_prob", "resume before"),
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.compute_ref_log_prob", "resume before"),
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.update_actor", "resume before"),
    ("verl.workers.engine_workers", "TrainingWorker.infer_batch", "resume before (critic)"),
    ("verl.checkpoint_engine.base", "CheckpointEngineManager.sleep_replicas",
     "rollout over: the background resume starts"),
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine.get_per_tensor_param",
     "weight sync through DTensor full_tensor(), which the guard cannot see"),
]
TRL = [
    ("trl", "GRPOTrainer._generate", "the phase"),
    ("trl", "GRPOTrainer._generate_single_turn", "begin seam (transformers generation)"),
    ("trl.generation.vllm_generation", "VLLMGeneration.generate", "begin seam (vLLM)"),
    ("trl.generation.vllm_generation", "VLLMGeneration.sync_weights",
     "re-push of FSDP2 weights inside generate (full_tensor(): groups kept)"),
    ("accelerate", "Accelerator.gather", "end seam: the first collective after generation"),
    ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "foreach_all_gather",
     "FSDP2's all-gather, through dist.all_gather_single (the guard sees it)"),
]


def resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check(rows, package: str) -> None:
    pytest.importorskip(package)
    missing = []
    for module, path, why in rows:
        try:
            resolve(module, path)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{module}.{path} ({why}): {exc}")
    assert not missing, "names the collective-path audit relies on are gone:\n" + "\n".join(missing)


def test_torch_names_and_process_group_methods():
    check(TORCH, "torch")
    import torch.distributed as dist

    from amem_callbacks.guard import GUARDED_METHODS

    absent = [names for names in PROCESS_GROUP_METHODS
              if not any(hasattr(dist.ProcessGroup, m) for m in names)]
    assert not absent, f"ProcessGroup lost {absent}: the guard's method list needs updating"
    present = [m for names in PROCESS_GROUP_METHODS for m in names
               if hasattr(dist.ProcessGroup, m)]
    unguarded = [m for m in present if m not in GUARDED_METHODS]
    assert not unguarded, f"the guard does not wrap {unguarded}"


def test_megatron_core_names():
    check(MEGATRON_CORE, "megatron.core")


def test_megatron_core_growth_names_where_0_17_is_installed():
    core = pytest.importorskip("megatron.core")
    major, minor = (int(x) for x in core.__version__.split(".")[:2])
    if (major, minor) < (0, 17):
        pytest.skip(f"megatron-core {core.__version__}: the KV growth needs 0.17+ (GPU run)")
    check(MEGATRON_CORE_GROWTH, "megatron.core")


def test_megatron_lm_names_where_it_is_importable():
    try:
        importlib.import_module("megatron.rl.rl_utils")
    except Exception as exc:  # not on PyPI; the GPU bundle carries it
        pytest.skip(f"Megatron-LM's megatron.rl is not importable here: {exc!r}")
    check(MEGATRON_LM, "megatron.rl")


def test_verl_names():
    check(VERL, "verl")


def test_trl_and_accelerate_names():
    check(TRL, "trl")
