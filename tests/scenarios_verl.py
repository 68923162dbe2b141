"""verl 0.9.1 scenarios: the real worker classes and methods, on gloo ranks.

What needs a GPU is replaced by stand-ins that record what they see: the
training engines (their collectives run on real gloo groups, each with a fake
NCCL communicator behind it), the rollout server adapter, the replicas, and
verl's CUDA helpers in ``verl.workers.engine_workers``. Everything else is
verl's own code: the config (hydra + dataclasses), ``ActorRolloutRefWorker``,
``TrainingWorker``, ``CheckpointEngineManager.sleep_replicas`` and
``Tracking.log``, with the hooks the adapter installed on them.

Run by tests.harness (``python -m tests.scenarios tests.scenarios_verl:NAME``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.scenarios import FakeNccl, init

from amem_callbacks.patching import is_wrapped as hooked  # noqa: E402  (touches no verl)
ADAPTER = "amem_callbacks.adapters.verl"
EVENTS: list = []  # (label, sorted names of the groups suspended at that moment)


# --- config -----------------------------------------------------------------
def compose(config_name: str = "ppo_trainer", overrides=()):
    """verl's real trainer config, composed by hydra as ``main_ppo`` does."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    base = ["actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "critic.ppo_micro_batch_size_per_gpu=2"]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name, overrides=base + list(overrides))


def tiny_model(path: str) -> str:
    """A two-file Qwen2 config and word-level tokenizer: enough for HFModelConfig."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    os.makedirs(path, exist_ok=True)
    Qwen2Config(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1,
                architectures=["Qwen2ForCausalLM"]).save_pretrained(path)
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", "a", "b"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def hook_report() -> dict:
    """Which verl methods carry the adapter's wrappers in this process."""
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.tracking import Tracking
    from verl.workers.config import RolloutConfig
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker
    from verl.workers.rollout.llm_server import LLMServerManager

    # Listed here, not imported from the adapter: importing it would install the hooks.
    out = {f"ActorRolloutRefWorker.{n}": hooked(getattr(ActorRolloutRefWorker, n, None))
           for n in ("compute_log_prob", "compute_ref_log_prob", "update_actor",
                     "save_checkpoint", "load_checkpoint", "update_weights", "init_model",
                     "amem_rollout_launching", "amem_rollout_ended", "amem_metrics")}
    out["LLMServerManager._initialize_llm_servers"] = hooked(
        LLMServerManager._initialize_llm_servers)
    out.update({f"TrainingWorker.{n}": hooked(getattr(TrainingWorker, n))
                for n in ("train_batch", "train_mini_batch", "infer_batch", "save_checkpoint",
                          "load_checkpoint")})
    out["CheckpointEngineManager.sleep_replicas"] = hooked(CheckpointEngineManager.sleep_replicas)
    out["Tracking.log"] = hooked(Tracking.log)
    out["RolloutConfig.__post_init__"] = hooked(RolloutConfig.__post_init__)
    return out


# --- scenarios: how the hooks get in ---------------------------------------
def entry_point(args):
    """A fresh interpreter: importing verl alone brings the adapter in."""
    before = ADAPTER in sys.modules
    import verl  # noqa: F401  (verl loads the "verl.plugins" entry points here)

    loaded_by_verl = ADAPTER in sys.modules
    import inspect

    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.single_controller.ray.base import _bind_workers_method_to_parent
    from verl.workers.engine_workers import ActorRolloutRefWorker

    # What create_colocated_worker_cls does with the class on the driver.
    class WorkerDict:
        pass

    _bind_workers_method_to_parent(WorkerDict, "actor_rollout_ref", ActorRolloutRefWorker)
    bound = {n: inspect.iscoroutinefunction(getattr(WorkerDict, n))
             for n in vars(WorkerDict) if n.startswith("actor_rollout_ref_")}
    return {"before": before, "loaded_by_verl": loaded_by_verl, "hooks": hook_report(),
            "update_weights_async": inspect.iscoroutinefunction(
                ActorRolloutRefWorker.update_weights),
            "dispatch": {n: str(getattr(getattr(ActorRolloutRefWorker, n), MAGIC_ATTR))
                         for n in ("amem_rollout_launching", "amem_rollout_ended",
                                   "amem_metrics", "update_weights")},
            "bound": bound}


def external_lib(args):
    """Entry points off: verl's own ``model.external_lib`` import installs the hooks."""
    assert os.environ.get("VERL_USE_EXTERNAL_PLUGINS") == "none"
    import verl.workers.engine_workers  # noqa: F401
    from verl.utils.config import omega_conf_to_dataclass

    before = {"loaded": ADAPTER in sys.modules, "hooks": hook_report()}
    cfg = compose(overrides=[f"actor_rollout_ref.model.path={tiny_model(args['model_dir'])}",
                             f"actor_rollout_ref.model.external_lib={ADAPTER}"])
    omega_conf_to_dataclass(cfg.actor_rollout_ref.model)  # HFModelConfig imports external_lib
    return {"before": before, "after": {"loaded": ADAPTER in sys.modules,
                                        "hooks": hook_report()}}


# --- stand-ins ---------------------------------------------------------------
class Recorder:
    def __init__(self, fake: FakeNccl):
        self.fake = fake

    def suspended(self) -> list:
        return sorted(name for name, down in self.fake.suspended().items() if down)

    def __call__(self, label: str) -> None:
        EVENTS.append((label, self.suspended()))


class StandInEngine:
    """The model engine a GPU would run: every call is a collective on its groups."""

    def __init__(self, label, groups: dict, handoff: dict, record: Recorder):
        self.label = label
        self.groups = groups  # name -> process group it trains on
        self.handoff = handoff  # name -> "all_gather" | "broadcast", as the weight export does
        self.record = record
        self.is_param_offload_enabled = False

    def _collectives(self, what: str) -> None:
        self.record(f"{self.label}.{what}")
        for group in self.groups.values():
            t = torch.ones(4)
            dist.all_reduce(t, group=group)
            assert torch.all(t == dist.get_world_size(group)), "wrong all_reduce result"

    @contextlib.contextmanager
    def train_mode(self, **kwargs):
        yield

    eval_mode = train_mode

    def infer_batch(self, data, loss_function=None):
        self._collectives("forward")
        return {}

    def train_batch(self, data, loss_function=None):
        self._collectives("train")
        return {}

    def lr_scheduler_step(self):
        return 0.0

    def is_mp_src_rank_with_outputs(self):
        return False

    def get_data_parallel_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def save_checkpoint(self, *args, **kwargs):
        self._collectives("save_checkpoint")

    def load_checkpoint(self, *args, **kwargs):
        self._collectives("load_checkpoint")

    def to(self, *args, **kwargs):
        pass

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=True):
        """Weights leave as a generator whose collectives run while the rollout consumes it."""

        def tensors():
            for name, how in self.handoff.items():
                group = self.groups[name]
                t = torch.full((2,), float(dist.get_rank()))
                if how == "broadcast":
                    dist.broadcast(t, src=dist.get_process_group_ranks(group)[0], group=group)
                else:
                    parts = [torch.empty(2) for _ in range(dist.get_world_size(group))]
                    dist.all_gather(parts, t, group=group)
                    t = torch.cat(parts)
                self.record(f"{self.label}.export {name}")
                yield name, t

        return tensors(), None


class StandInRollout:
    """The vLLM ServerAdapter in the trainer process: talks to the server, no collectives."""

    sleep_level = 2

    def __init__(self, record: Recorder):
        self.record = record

    async def resume(self, tags):
        self.record("rollout.resume " + ",".join(tags))

    async def update_weights(self, weights, **kwargs):
        count = sum(1 for _ in weights)
        self.record(f"rollout.update_weights {count} tensors")


class StandInCheckpointEngine:
    """A disaggregated checkpoint engine (nccl/nixl): sends the weights away."""

    def __init__(self, record: Recorder):
        self.record = record

    async def send_weights(self, weights, global_steps=None):
        count = sum(1 for _ in weights)
        self.record(f"checkpoint_engine.send_weights {count} tensors")
        return {}


class StandInReplica:
    def __init__(self, record: Recorder):
        self.record = record

    async def sleep(self):
        self.record("replica.sleep")


def launching_replica_class(record: Recorder):
    """A rollout replica whose hybrid launch records the groups suspended when its
    engine would allocate its weights and KV cache (verl's replicas, Ray left out)."""

    class LaunchingReplica:
        def __init__(self, replica_rank, config, model_config, gpus_per_node):
            self.replica_rank = replica_rank

        async def init_hybrid(self, worker_group):
            record("replica.launch (weights and KV cache allocated)")
            self._server_handle, self._server_address = None, f"replica-{self.replica_rank}"

        async def init_standalone(self):  # on GPUs of its own
            record("replica.launch standalone")
            self._server_handle, self._server_address = None, f"replica-{self.replica_rank}"

    return LaunchingReplica


class LocalWorkerGroup:
    """The actor worker group as the driver sees it (Ray left out): each call runs the
    worker's registered method on this rank and returns the per-rank list."""

    def __init__(self, worker):
        self.worker = worker
        self.calls: list = []
        self.world_size = dist.get_world_size()  # the group's ranks (one replica of 2)

    def amem_rollout_launching(self):
        self.calls.append("amem_rollout_launching")
        return [self.worker.amem_rollout_launching()]

    def amem_rollout_ended(self):
        self.calls.append("amem_rollout_ended")
        return [self.worker.amem_rollout_ended()]

    def amem_metrics(self):
        self.calls.append("amem_metrics")
        return [self.worker.amem_metrics()]


class CaptureLogger:
    def __init__(self):
        self.logged: list = []

    def log(self, data, step):
        self.logged.append((step, dict(data)))


class _CpuDevice:
    """verl's device module on a machine without CUDA."""

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def synchronize():
        pass


def cpu_stand_ins(engine_workers) -> None:
    engine_workers.get_torch_device = lambda: _CpuDevice
    engine_workers.set_expandable_segments = lambda enable: None
    engine_workers.log_gpu_memory_usage = lambda *args, **kwargs: None


def training_worker(engine):
    """A real TrainingWorker without __init__ (which builds the GPU engine)."""
    from verl.utils.profiler import DistProfiler
    from verl.workers.engine_workers import TrainingWorker

    worker = object.__new__(TrainingWorker)
    worker.engine = engine
    worker.engine_config = SimpleNamespace(
        use_dynamic_bsz=False, max_token_len_per_gpu=None, micro_batch_size_per_gpu=2,
        infer_max_token_len_per_gpu=None, infer_micro_batch_size_per_gpu=2,
        use_fused_kernels=False, forward_only=False)
    worker.model_config = {}
    worker.loss_fn = lambda *args, **kwargs: None
    worker.flops_counter = None
    worker.device_name = "cpu"
    worker.profiler = DistProfiler(rank=dist.get_rank(), config=None)
    return worker


def batch(train: bool = False):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    data = TensorDict({"x": torch.zeros(4, 1)}, batch_size=[4])
    if train:
        tu.assign_non_tensor(data, mini_batch_size=2, epochs=1, seed=1)
    return data


def make_groups(strategy: str) -> dict:
    """The training groups of each model, named as verl's engines name them."""
    ranks = list(range(dist.get_world_size()))

    def group(desc):
        return dist.new_group(ranks, group_desc=desc)

    if strategy == "megatron":  # parallel_state is shared by actor and ref
        shared = {"tp": group("TENSOR_MODEL_PARALLEL_GROUP"),
                  "pp": group("PIPELINE_MODEL_PARALLEL_GROUP"),
                  "dp": group("DATA_PARALLEL_GROUP")}
        return {"actor": shared, "ref": shared, "critic": {"dp": group("critic_dp")},
                "handoff": {"pp": "broadcast", "tp": "all_gather"}}
    return {"actor": {"fsdp": group("mesh_fsdp")}, "ref": {"fsdp": group("mesh_ref_fsdp")},
            "critic": {"fsdp": group("mesh_critic_fsdp")}, "handoff": {"fsdp": "all_gather"}}


# --- the main scenario ---------------------------------------------------------
def worker_cycle(args):
    """One process per rank plays the driver and its own training worker.

    args: strategy ("fsdp"|"megatron"), amem ("on"|"off"|"absent"),
    early (call sleep_replicas after rollout), free_cache_engine,
    mode (what the driver passes to update_weights: "naive" or e.g. "nccl").
    """
    init()
    fake = FakeNccl()
    record = Recorder(fake)

    import verl.workers.engine_workers as engine_workers
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.tracking import Tracking

    import amem_callbacks.adapters.verl as adapter
    from amem_callbacks import OffloadPolicy

    overrides = [f"actor_rollout_ref.rollout.free_cache_engine={args['free_cache_engine']}"]
    hybrid = args["mode"] == "naive"  # else the rollout has GPUs of its own: one node
    overrides += [] if hybrid else ["actor_rollout_ref.rollout.nnodes=1",
                                    "actor_rollout_ref.rollout.n_gpus_per_node=2"]
    if args["amem"] != "absent":
        enable = "true" if args["amem"] == "on" else "false"
        overrides += [f"+actor_rollout_ref.rollout.custom.amem.enable={enable}",
                      "+actor_rollout_ref.rollout.custom.amem.guard=strict"]
    config_name = "ppo_megatron_trainer" if args["strategy"] == "megatron" else "ppo_trainer"
    cfg = compose(config_name, overrides)
    rollout_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # as the driver does

    class SpyPolicy(OffloadPolicy):
        def begin(self, phase="rollout"):
            record("amem.begin")
            return super().begin(phase)

        def end(self, phase=None):
            record(f"amem.end on {threading.current_thread().name}")
            return super().end(phase)

    adapter.make_policy = lambda s: SpyPolicy(s.options(backend=fake.backend()))
    import amem_callbacks.headroom as headroom

    headroom.gpu_total_bytes = lambda device=None: 80 * 2**30  # an 80 GiB GPU, on the CPU
    cpu_stand_ins(engine_workers)

    groups = make_groups(args["strategy"])
    handoff = groups["handoff"]
    worker = object.__new__(engine_workers.ActorRolloutRefWorker)
    worker.config = cfg.actor_rollout_ref
    worker.role = "actor_rollout_ref"
    worker.enable_routing_replay = False
    worker.actor = training_worker(StandInEngine("actor", groups["actor"], handoff, record))
    worker.ref = training_worker(StandInEngine("ref", groups["ref"], {}, record))
    worker.rollout = StandInRollout(record)
    worker.checkpoint_engine = StandInCheckpointEngine(record)
    worker.layered_summon = False
    worker.peft_merge = False
    worker.base_sync_done = True
    critic = training_worker(StandInEngine("critic", groups["critic"], {}, record))

    manager = object.__new__(CheckpointEngineManager)
    manager.replicas = [StandInReplica(record)]
    manager.actor_wg = LocalWorkerGroup(worker)
    tracking = object.__new__(Tracking)
    tracking.logger = {"capture": CaptureLogger()}

    def update_weights(step):
        record("driver: update_weights")
        asyncio.run(worker.update_weights(global_steps=step, mode=args["mode"]))
        record("driver: update_weights returned")

    # RayPPOTrainer.init_workers: verl's own LLMServerManager launches the servers (its
    # replica class a stand-in), then the checkpoint manager puts them to sleep; fit():
    # load, first weight sync.
    from verl.workers.rollout.llm_server import LLMServerManager

    class ServerManager(LLMServerManager):
        rollout_replica_class = launching_replica_class(record)

    servers = ServerManager(cfg, worker_group=manager.actor_wg if hybrid else None)
    asyncio.run(servers._initialize_llm_servers())
    manager.sleep_replicas()
    worker.load_checkpoint("/nonexistent")
    update_weights(0)
    for step in (1, 2):
        record("rollout")  # the servers generate; the training worker is idle
        if args["early"]:
            manager.sleep_replicas()
        if step == 1:  # fit's order
            worker.compute_log_prob(batch())
            worker.compute_ref_log_prob(batch())
            critic.infer_batch(batch())
            critic.train_mini_batch(batch(train=True))
        else:  # rollout-correction bypass, no reference: the critic is the first caller
            critic.infer_batch(batch())
            critic.train_mini_batch(batch(train=True))
        worker.update_actor(batch(train=True))
        if step == 2:
            worker.save_checkpoint("/nonexistent")
        update_weights(step)
        tracking.log(data={"training/global_step": step}, step=step)

    session = adapter.current_session()
    return {
        "events": EVENTS,
        "custom": rollout_config.custom,
        "driver_calls": manager.actor_wg.calls,
        "logged": tracking.logger["capture"].logged,
        "session": None if session is None else {
            "counters": session.policy.metrics(last=False),
            "metrics": session.metrics(),
            "utilization_now": session.gpu_memory_utilization,
            "headroom_line": session.headroom.line() if session.headroom else None},
    }


def bad_config(args):
    """A wrong ``amem`` block stops the worker's init_model before any model is built."""
    import verl.workers.engine_workers as engine_workers

    cfg = compose(overrides=[f"+actor_rollout_ref.rollout.custom.amem.{k}={v}"
                             for k, v in args["block"].items()])
    worker = object.__new__(engine_workers.ActorRolloutRefWorker)
    worker.config = cfg.actor_rollout_ref
    try:
        worker.init_model()
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def unknown_keep_group(args):
    """keep names a group nobody has: the first weight sync (before the first
    rollout and training step) fails, naming the valid names."""
    import verl.workers.engine_workers as engine_workers

    init()
    cfg = compose(overrides=["+actor_rollout_ref.rollout.custom.amem.enable=true",
                             "+actor_rollout_ref.rollout.custom.amem.keep=[nope]"])
    worker = object.__new__(engine_workers.ActorRolloutRefWorker)
    worker.config = cfg.actor_rollout_ref
    worker.role = "actor_rollout_ref"
    try:
        asyncio.run(worker.update_weights(global_steps=0))
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def replica_peers(args):
    """keep: [world], and each rank suspends only a group of its own, so no
    suspended group links the ranks of one replica. Rank 1's suspend is slow;
    rank 0 (the replica's leader, which wakes the KV cache on every GPU of the
    replica) must not come back from suspend() before rank 1's memory is free.
    Times are CLOCK_MONOTONIC, the same clock in every process of the machine."""
    import amem_callbacks.adapters.verl as adapter
    from amem_callbacks import OffloadPolicy, name_group

    init()
    fake = FakeNccl()
    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    own = singles[rank]
    name_group(own, f"single_{rank}")
    fake.controls.delay(fake.handle_of(own)[0], args.get("delay_us", 0) if rank == 1 else 0)
    policy = OffloadPolicy(backend=fake.backend(), keep=["world"], groups=[own],
                           agree_timeout_s=20)
    session = adapter.WorkerSession(adapter.AmemSettings(enable=True, keep=("world",)), policy)
    cycles = []
    for _ in range(2):
        session.suspend()
        returned = time.monotonic()
        begin = session.reports["begin"]
        cycles.append({"freed_at": begin.started + begin.wall_seconds, "returned_at": returned,
                       "suspended": [g.name for g in begin.suspended]})
        session.resume()
    return {"cycles": cycles}
