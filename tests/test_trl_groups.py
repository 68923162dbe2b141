"""TRL adapter: which groups a sharded model's generation keeps, on real FSDP2.

Four gloo ranks (tests.harness), torch's own ``fully_shard`` on CPU:
- HSDP, mesh ("dp_replicate", "dp_shard") as accelerate's ParallelismConfig
  builds it (with its flattened "dp" group): parameters are
  ``(Replicate(), Shard(0))``, so only the dp_shard groups gather parameters;
  the dp_replicate groups serve the backward all-reduce alone;
- plain FSDP2 over a 1-D mesh of the whole world: DeviceMesh reuses the default
  group, so world is the sharding group and is kept for that reason; except
  where CUDA is available and the default group is gloo (these gloo tests on a
  GPU host, any torch 2.11-2.15: ``DeviceMesh._init_process_groups``), where the
  mesh gets a group of its own and world is kept for generate's finished flag.
  Both rules run on every host: the scenario sets the answer DeviceMesh reads;
- a tiny Qwen2 sharded the way accelerate shards it for HSDP, whose real
  ``generate`` is traced: every group it calls must be kept, and the replicate
  groups are never called (they are the ones left to suspend).
The scenarios run in the rank processes (``tests.test_trl_groups:<name>``).
"""

import functools
import os
import types

import pytest

from tests.harness import run_ranks

pytest.importorskip("torch.distributed.fsdp")

WORLD = 4
FSDP2_SHARDS = "FSDP2 all-gathers parameters over mesh dim {} while generating"


# --- run in the rank processes -----------------------------------------------------
def _init():
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # four ranks share the machine's cores
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))


def _label(named: dict):
    """group -> readable label: "world", the mesh dims it is, or its ranks."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()

    def label(group) -> str:
        names = (["world"] if group is world else []) + sorted(
            name for name, g in named.items() if g is group)
        return "+".join(names) or f"ranks{sorted(dist.get_process_group_ranks(group))}"
    return label


def _fake_trainer(model, vllm_sleep_mode: bool = False):
    """What groups_generation_uses reads: an accelerator state with an FSDP plugin
    (as accelerate's FSDP2 sets it), the model; optionally vLLM colocate with sleep
    mode and tools (weights synced again inside the phase, no transformers generate)."""
    state = types.SimpleNamespace(fsdp_plugin=types.SimpleNamespace(fsdp_version=2),
                                  deepspeed_plugin=None)
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(state=state), model=model,
                                    use_vllm=vllm_sleep_mode)
    if vllm_sleep_mode:
        trainer.vllm_generation = types.SimpleNamespace(
            mode="colocate", enable_sleep_mode=True, tp_group=None, tensor_parallel_size=1)
        trainer.tools = [print]
    return trainer


def _uses(trainer, label) -> dict:
    from amem_callbacks.adapters._trl_groups import generation_mode, groups_generation_uses

    found = {}
    for group, _role, why in groups_generation_uses(trainer, generation_mode(trainer)):
        found.setdefault(label(group), why)  # the callback keeps the first reason too
    return found


def _tiny_sharded(mesh, **options):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def _meshes_as_on(cuda_host: bool):
    """DeviceMesh gives a whole-world dim the default group, unless
    ``torch.cuda.is_available()`` and the default group is gloo: then a group
    of its own. Answer that one question as a CPU host or a GPU host would
    while the meshes are built, so both rules run on every machine."""
    import contextlib
    from unittest import mock

    import torch

    if cuda_host == torch.cuda.is_available():
        return contextlib.nullcontext()
    return mock.patch("torch.distributed.device_mesh.torch.cuda.is_available",
                      return_value=cuda_host)


def hsdp_and_1d(args):
    """The groups kept for an HSDP model and for a 1-D FSDP2 model."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    from amem_callbacks.sharded import groups_gathered_over

    _init()
    world = c10d._get_default_group()
    out = {}
    with _meshes_as_on(args["cuda_host"]):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")  # accelerate adds this one
        mesh1 = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    out["flat_is_world"] = flat.get_group() is world
    named = {"dp_replicate": mesh.get_group("dp_replicate"), "dp_shard": mesh.get_group("dp_shard"),
             "dp": flat.get_group()}
    label = _label(named)
    model = _tiny_sharded(mesh)
    param = next(model.parameters())
    out["hsdp"] = {
        "placements": [type(p).__name__ for p in param.placements],
        "mesh_groups": sorted(label(g) for g in mesh.get_all_groups()),
        "sharding_groups": sorted(label(g) for g, _role, _why in groups_gathered_over(model)),
        "transformers": _uses(_fake_trainer(model), label),
        "vllm_colocate_sleep": _uses(_fake_trainer(model, vllm_sleep_mode=True), label)}
    label1 = _label({"dp_shard": mesh1.get_group(0)})
    model1 = _tiny_sharded(mesh1)
    out["one_d"] = {
        "mesh_group_is_world": mesh1.get_group(0) is world,
        "sharding_groups": sorted(label1(g) for g, _role, _why in groups_gathered_over(model1)),
        "transformers": _uses(_fake_trainer(model1), label1),
        "vllm_colocate_sleep": _uses(_fake_trainer(model1, vllm_sleep_mode=True), label1)}
    # reshard_after_forward=2: after forward, the layers gather over pairs of ranks,
    # a group on no parameter's mesh
    model2 = _tiny_sharded(mesh1, reshard_after_forward=2)
    used: list = []
    undo = _trace_collectives(used)
    try:
        with torch.no_grad():
            for _ in range(3):  # unsharded, then resharded to pairs after each forward
                model2(torch.ones(2, 8))
    finally:
        undo()
    kept = groups_gathered_over(model2)
    out["reshard_to_2"] = [[label1(g), dist.get_world_size(g), why] for g, _role, why in kept]
    out["reshard_to_2_used_kept"] = {id(g) for _, g in used} <= {id(g) for g, _, _ in kept}
    out["reshard_to_2_used_pairs"] = any(dist.get_world_size(g) == 2 for _, g in used)
    return out


def _trace_collectives(used: list):
    """Record (method, group) of every ProcessGroup call the guard can see."""
    import torch.distributed as dist

    from amem_callbacks.guard import GUARDED_METHODS

    cls = dist.ProcessGroup
    undo = []
    for name in GUARDED_METHODS:
        if name not in cls.__dict__:
            continue
        raw, original = cls.__dict__[name], getattr(cls, name)

        def traced(self, *a, _original=original, _name=name, **k):
            used.append((_name, self))
            return _original(self, *a, **k)

        setattr(cls, name, traced)
        undo.append((name, raw))
    return lambda: [setattr(cls, n, f) for n, f in undo]


def accelerate_hsdp_generate(args):
    """A tiny Qwen2 sharded as accelerate shards it for ParallelismConfig(dp_replicate_size=2,
    dp_shard_size=2); the groups kept, and the groups its real generate() calls."""
    import torch
    from accelerate.parallelism_config import ParallelismConfig
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _init()
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    mesh = config.build_device_mesh("cpu")
    named = {}
    for dim in ("dp_replicate", "dp_shard", "dp", "dp_shard_cp", "dp_cp"):
        named[dim] = mesh[dim].get_group()
    label = _label(named)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, tie_word_embeddings=True))
    fsdp_mesh = mesh[tuple(config.fsdp_dim_names)]
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    kept = _uses(_fake_trainer(model), label)
    log_line = _callback_log_line(_fake_trainer(model))
    used: list = []
    undo = _trace_collectives(used)
    try:
        with torch.no_grad():
            model.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=4,
                           min_new_tokens=4, do_sample=False)
    finally:
        undo()
    return {"kept": kept, "used": sorted({f"{name}@{label(g)}" for name, g in used}),
            "all": sorted({label(g) for g in named.values()}), "log_line": log_line}


def _callback_log_line(trainer) -> str:
    """The one line AMemCallback logs about the groups it keeps (its policy set-up)."""
    import logging

    from amem_callbacks.adapters.trl import AMemCallback

    lines = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "generation uses these groups" in record.getMessage():
                lines.append(record.getMessage())

    handler = Catch()
    logging.getLogger("amem_callbacks").addHandler(handler)
    try:
        callback = AMemCallback(backend="noop")
        callback.trainer, callback.mode = trainer, "transformers"
        callback._make_policy()
    finally:
        logging.getLogger("amem_callbacks").removeHandler(handler)
    return "\n".join(lines)


# --- the tests ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def results(scenario, cuda_host=False):
    return [r["result"] for r in run_ranks(f"tests.test_trl_groups:{scenario}", world=WORLD,
                                           timeout=240, args={"cuda_host": cuda_host})]


#: DeviceMesh's two rules for a whole-world dim (see the module docstring)
HOSTS = pytest.mark.parametrize("cuda_host", [False, True], ids=["cpu_host", "cuda_host"])


@HOSTS
def test_hsdp_gathers_only_over_the_shard_dim(cuda_host):
    for res in results("hsdp_and_1d", cuda_host):
        hsdp = res["hsdp"]
        assert hsdp["placements"] == ["Replicate", "Shard"]
        assert hsdp["mesh_groups"] == ["dp_replicate", "dp_shard"]
        assert hsdp["sharding_groups"] == ["dp_shard"]


@HOSTS
def test_hsdp_replicate_groups_are_left_to_suspend(cuda_host):
    for res in results("hsdp_and_1d", cuda_host):
        for mode in ("transformers", "vllm_colocate_sleep"):
            kept = res["hsdp"][mode]
            assert kept["dp_shard"] == FSDP2_SHARDS.format("dp_shard")
            assert "dp_replicate" not in kept
        # vLLM generates: only the weight sync gathers, over the shard dim
        assert set(res["hsdp"]["vllm_colocate_sleep"]) == {"dp_shard"}


@HOSTS
def test_transformers_generate_keeps_world_for_its_finished_flag(cuda_host):
    for res in results("hsdp_and_1d", cuda_host):
        assert res["flat_is_world"] is not cuda_host  # the rule this run exercised
        world = "world" if cuda_host else "world+dp"
        kept = res["hsdp"]["transformers"]
        assert set(kept) == {world, "dp_shard"}
        assert "synced_gpus" in kept[world]


@HOSTS
def test_one_d_fsdp2_over_the_world_keeps_world(cuda_host):
    """World is kept either way: as the shard group (the mesh reused it), or for
    generate's finished flag beside the mesh's own group."""
    for res in results("hsdp_and_1d", cuda_host):
        one_d = res["one_d"]
        assert one_d["mesh_group_is_world"] is not cuda_host
        shards = FSDP2_SHARDS.format("dp_shard")
        if not cuda_host:
            assert one_d["sharding_groups"] == ["world+dp_shard"]
            for mode in ("transformers", "vllm_colocate_sleep"):
                assert one_d[mode] == {"world+dp_shard": shards}
        else:
            assert one_d["sharding_groups"] == ["dp_shard"]
            assert set(one_d["transformers"]) == {"dp_shard", "world"}
            assert one_d["transformers"]["dp_shard"] == shards
            assert "synced_gpus" in one_d["transformers"]["world"]
            # vLLM generates: only the weight re-sync gathers, over the mesh's group
            assert one_d["vllm_colocate_sleep"] == {"dp_shard": shards}


@HOSTS
def test_reshard_after_forward_to_a_smaller_group_keeps_that_group_too(cuda_host):
    for res in results("hsdp_and_1d", cuda_host):
        entries = res["reshard_to_2"]
        shard = "dp_shard" if cuda_host else "world+dp_shard"
        assert entries[0] == [shard, WORLD, FSDP2_SHARDS.format("dp_shard")]
        # one pair group per fully_shard call that has parameters (each builds its own mesh)
        assert len(entries) == 3
        for _label, size, why in entries[1:]:
            assert size == 2 and "reshard_after_forward" in why
        assert res["reshard_to_2_used_pairs"] and res["reshard_to_2_used_kept"]


def test_real_generate_calls_only_kept_groups_and_never_the_replicate_group():
    pytest.importorskip("accelerate.parallelism_config")
    pytest.importorskip("transformers")
    for res in results("accelerate_hsdp_generate"):
        kept, used = res["kept"], res["used"]
        assert "dp_replicate" in res["all"]
        assert kept.get("dp_shard_cp") == FSDP2_SHARDS.format("dp_shard_cp")
        assert "dp_replicate" not in kept
        assert {u.split("@")[1] for u in used} <= set(kept), (used, kept)
        # what generate really calls: the finished flag on world, the gathers on dp_shard_cp
        assert any(u.startswith("allreduce@world") for u in used)
        assert any(u.endswith("@dp_shard_cp") for u in used)
        # one log line names both kept groups with their reasons, and not the replicate group
        line = res["log_line"]
        assert line.count("\n") == 0 and "dp_replicate" not in line
        assert f"'dp_shard_cp' ({FSDP2_SHARDS.format('dp_shard_cp')})" in line
        assert "'world' (transformers' generate all-reduces a finished flag" in line
