"""verl 0.9.1 adapter: config, how the hooks get in, and where suspend/resume
happen when verl's real worker methods run on two gloo ranks."""

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from tests.harness import run_ranks  # noqa: E402
from tests.scenarios_verl import compose, tiny_model  # noqa: E402

import amem_callbacks.adapters.verl as adapter  # noqa: E402

VALID = "valid keys: enable (true or false), backend"


@pytest.fixture(autouse=True)
def _driver_state():
    """Converting a config with amem on marks this process as a driver: undo it."""
    yield
    adapter._driver.enabled = False


# --- configuration ---------------------------------------------------------------
def test_the_block_composes_validates_and_converts_to_verls_dataclasses(tmp_path):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import HFModelConfig, RolloutConfig

    model = tiny_model(str(tmp_path / "model"))
    cfg = compose(overrides=[
        "+actor_rollout_ref.rollout.custom.amem.enable=true",
        "+actor_rollout_ref.rollout.custom.amem.keep=[world]",
        "+actor_rollout_ref.rollout.custom.amem.learn_keep=false",
        "+actor_rollout_ref.rollout.custom.amem.guard=strict",
        "+actor_rollout_ref.rollout.custom.amem.backend=noop",
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}"])
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg),
                    use_critic=need_critic(cfg))
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert isinstance(rollout, RolloutConfig)
    assert rollout.custom == {"amem": {"enable": True, "keep": ["world"], "learn_keep": False,
                                       "guard": "strict", "backend": "noop"}}
    assert isinstance(omega_conf_to_dataclass(cfg.actor_rollout_ref.model), HFModelConfig)
    omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
    omega_conf_to_dataclass(cfg.critic)
    assert adapter.read_settings(rollout.custom) == adapter.AmemSettings(
        enable=True, backend="noop", keep=("world",), learn_keep=False, guard="strict")
    assert adapter._driver.enabled

    megatron = compose("ppo_megatron_trainer",
                       ["+actor_rollout_ref.rollout.custom.amem.enable=true"])
    assert omega_conf_to_dataclass(megatron.actor_rollout_ref.rollout).custom["amem"]["enable"]
    omega_conf_to_dataclass(megatron.actor_rollout_ref.actor)


@pytest.mark.parametrize("override, says", [
    ("enabel=true", "unknown key(s) ['enabel']"),
    ("enable=yes", "amem.enable must be true or false, got 'yes'"),
    ("keep=tp", "amem.keep must be a list of group names"),
    ("keep=[1]", "amem.keep must be a list of group names"),
    ("learn_keep=1", "amem.learn_keep must be true or false, got 1"),
    ("overlap=true", "nothing left to overlap: remove the key"),
    ("backend=cuda", "unknown backend 'cuda'"),
    ("guard=loud", "unknown guard mode 'loud'"),
])
def test_a_bad_block_fails_at_conversion_naming_the_valid_keys(override, says):
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose(overrides=[f"+actor_rollout_ref.rollout.custom.amem.{override}"])
    with pytest.raises(Exception) as info:
        omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert says in str(info.value) and VALID in str(info.value)


def test_a_bad_block_stops_init_model_before_any_model_is_built():
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = object.__new__(ActorRolloutRefWorker)  # no engine, no rollout: it must not get there
    worker.config = compose(overrides=["+actor_rollout_ref.rollout.custom.amem.keepp=[tp]"]
                            ).actor_rollout_ref
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['keepp'\]; valid keys"):
        worker.init_model()


@pytest.mark.parametrize("custom", [None, {}, {"other": 1}, {"amem": None},
                                    {"amem": {"enable": False, "guard": "strict"}}])
def test_no_block_or_enable_false_means_off(custom):
    assert adapter.read_settings(custom).enable is False


def test_metrics_of_the_ranks_merge_to_the_slowest_time_and_mean_of_the_rest():
    merged = adapter.merge_rank_metrics([
        {"amem/begin/seconds": 1.0, "amem/begin/nccl_bytes": 100},
        {"amem/begin/seconds": 3.0, "amem/begin/nccl_bytes": 300}, {}])
    assert merged == {"amem/begin/seconds": 3.0, "amem/begin/nccl_bytes": 200.0}


# --- how the hooks get in ----------------------------------------------------------
def one_rank(scenario, **kwargs):
    (res,) = run_ranks(f"tests.scenarios_verl:{scenario}", world=1, timeout=240, **kwargs)
    return res["result"]


def test_importing_verl_in_a_fresh_process_installs_the_hooks_via_the_entry_point():
    res = one_rank("entry_point")
    assert res["before"] is False and res["loaded_by_verl"] is True
    assert res["hooks"] and all(res["hooks"].values()), res["hooks"]
    assert res["update_weights_async"] is True
    for added in ("amem_rollout_launching", "amem_rollout_ended", "amem_metrics"):
        assert "ONE_TO_ALL" in res["dispatch"][added], added
    # what create_colocated_worker_cls binds on the driver: our methods, update_weights still async
    assert res["bound"]["actor_rollout_ref_amem_rollout_ended"] is False
    assert res["bound"]["actor_rollout_ref_update_weights"] is True


def test_model_external_lib_installs_the_hooks_when_entry_points_are_off(tmp_path):
    res = one_rank("external_lib", args={"model_dir": str(tmp_path / "model")},
                   env={"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert res["before"]["loaded"] is False and not any(res["before"]["hooks"].values())
    assert res["after"]["loaded"] is True and all(res["after"]["hooks"].values())


# --- the boundaries, on two ranks ----------------------------------------------------
def cycle(**args):
    base = {"strategy": "fsdp", "amem": "on", "early": True, "free_cache_engine": True,
            "mode": "naive"}
    base.update(args)
    results = [r["result"] for r in run_ranks("tests.scenarios_verl:worker_cycle", world=2,
                                              args=base, timeout=300)]
    assert results[0]["events"] == results[1]["events"], \
        "both ranks must see the same sequence"
    assert [e[0] for e in results[0]["events"]] == [e[0] for e in results[1]["events"]]
    return results


def labels(events):
    return [label for label, _ in events]


def training(first_step: bool, save: bool) -> list:
    actor_and_ref = ["actor.forward", "ref.forward"] if first_step else []
    return (actor_and_ref + ["critic.forward"] + ["critic.train"] * 2 + ["actor.train"] * 2
            + (["actor.save_checkpoint"] if save else []))


def test_fsdp_suspends_after_the_handoff_before_the_kv_cache_and_resumes_when_rollout_ends():
    fsdp_groups = ["mesh_critic_fsdp", "mesh_fsdp", "mesh_ref_fsdp", "world"]
    for res in cycle(strategy="fsdp", early=True):
        ALL = fsdp_groups

        def sync():
            return [("driver: update_weights", []), ("rollout.resume weights", []),
                    ("actor.export fsdp", []),  # the weights gather over fsdp: active
                    ("rollout.update_weights 1 tensors", []),
                    ("amem.begin", []),
                    ("rollout.resume kv_cache", ALL),  # freed before the KV cache returns
                    ("driver: update_weights returned", ALL)]

        def step(first):
            return ([("rollout", ALL), ("replica.sleep", ALL),
                     ("amem.end on asyncio_0", ALL)]  # the driver's sleep_replicas thread: resumes start
                    + [(label, []) for label in training(first, save=not first)] + sync())

        # the servers' launch allocates their KV cache: suspended before it, resumed at
        # the sleep_replicas that follows it
        launch = [("amem.begin", []), ("replica.launch (weights and KV cache allocated)", ALL),
                  ("replica.sleep", ALL), ("amem.end on asyncio_0", ALL)]
        expected = (launch + [("actor.load_checkpoint", [])] + sync()
                    + step(True) + step(False))
        assert [tuple(e) for e in res["events"]] == expected
        counters = res["session"]["counters"]
        assert counters["amem/total/begins"] == 4 and counters["amem/total/ends"] == 3
        assert counters["amem/total/group_suspends"] == 4 * len(ALL)
        assert counters["amem/total/group_resumes"] == 3 * len(ALL)
        assert counters["amem/total/auto_resumes"] == 0 and counters["amem/total/failures"] == 0
        assert res["driver_calls"] == ["amem_rollout_launching", "amem_rollout_ended",
                                       "amem_rollout_ended", "amem_metrics",
                                       "amem_rollout_ended", "amem_metrics"]
        (step1, log1), (step2, log2) = res["logged"]
        assert (step1, step2) == (1, 2) and log1["training/global_step"] == 1
        assert log1["amem/begin/groups_suspended"] == len(ALL)
        assert log1["amem/end/groups_resumed"] == len(ALL)
        assert (log1["amem/total/begins"], log2["amem/total/begins"]) == (3, 4)
        # where they came, in verl's own tracking: every suspend right before the KV
        # cache, every end at the driver's sleep_replicas, none left to a training call
        assert log2["amem/verl/suspends_before_kv_cache"] == 3
        assert log2["amem/verl/suspends_before_launch"] == 1
        assert log2["amem/verl/ends_at_sleep_replicas"] == 3
        assert log2["amem/verl/ends_at_training_call"] == 0
        assert "amem/verl/suspends_without_kv_cache" not in log2
        assert log2["amem/begin/nccl_bytes"] == len(ALL) * 480 * 2**20


def test_megatron_without_kv_cache_release_suspends_at_the_end_of_the_update():
    for res in cycle(strategy="megatron", early=False, free_cache_engine=False):
        ALL = ["DATA_PARALLEL_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP",
               "TENSOR_MODEL_PARALLEL_GROUP", "critic_dp", "world"]
        events = [tuple(e) for e in res["events"]]
        sync = ["driver: update_weights", "actor.export pp", "actor.export tp",
                "rollout.update_weights 2 tensors", "amem.begin", "driver: update_weights returned"]

        def step(first):
            # no early signal: the first training call resumes (the critic's in step 2)
            return ["rollout", "amem.end on MainThread"] + training(first, save=not first) + sync

        launch = ["amem.begin", "replica.launch (weights and KV cache allocated)",
                  "replica.sleep", "amem.end on asyncio_0"]
        assert labels(events) == (launch + ["actor.load_checkpoint"] + sync
                                  + step(True) + step(False))
        for label, down in events:
            if label.startswith("actor.export") or label == "amem.begin":
                assert down == [], f"{label}: the hand-off groups must be active"
            if label in ("driver: update_weights returned", "rollout", "amem.end on MainThread",
                         "replica.launch (weights and KV cache allocated)", "replica.sleep"):
                assert down == ALL, label
        # the strict guard saw no call on a suspended one
        counters = res["session"]["counters"]
        assert counters["amem/total/begins"] == 4 and counters["amem/total/ends"] == 3
        assert counters["amem/total/auto_resumes"] == 0 and counters["amem/total/failures"] == 0
        assert res["driver_calls"] == ["amem_rollout_launching", "amem_rollout_ended",
                                       "amem_metrics", "amem_metrics"]
        seams = {k: v for k, v in res["session"]["metrics"].items() if k.startswith("amem/verl/")}
        assert seams == {"amem/verl/suspends_without_kv_cache": 3,
                         "amem/verl/suspends_before_launch": 1,
                         "amem/verl/ends_at_sleep_replicas": 1,
                         "amem/verl/ends_at_training_call": 2}


def test_enable_false_leaves_verl_untouched():
    for res in cycle(amem="off"):
        assert res["session"] is None and res["driver_calls"] == []
        assert all(down == [] for _label, down in res["events"])
        assert not any(label.startswith("amem") for label, _ in res["events"])
        assert [data for _step, data in res["logged"]] == [{"training/global_step": 1},
                                                          {"training/global_step": 2}]


def test_a_disaggregated_checkpoint_engine_suspends_nothing():
    for res in cycle(mode="nccl"):
        events = res["events"]
        assert "checkpoint_engine.send_weights 1 tensors" in labels(events)
        # the servers launched on GPUs of their own: nothing suspended for it
        assert labels(events)[0] == "replica.launch standalone"
        assert not any(label.startswith("amem") for label in labels(events))
        assert all(down == [] for _label, down in events)
        assert res["session"]["counters"]["amem/total/begins"] == 0


def test_the_example_script_composes_verls_config_with_the_block():
    import os
    import subprocess

    import yaml

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["bash", os.path.join(root, "examples", "verl", "run_ppo_amem.sh"),
                          "--cfg", "job"], capture_output=True, text=True, timeout=180, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = yaml.safe_load(out.stdout)
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    job = OmegaConf.create(cfg)  # the checks main_ppo runs before it starts Ray
    validate_config(job, use_reference_policy=need_reference_policy(job),
                    use_critic=need_critic(job))
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert rollout["name"] == "vllm" and rollout["checkpoint_engine"]["backend"] == "naive"
    assert adapter.read_settings(rollout["custom"]).enable is True


def test_a_replica_leader_returns_from_suspend_only_when_every_rank_has_freed():
    ranks = [r["result"] for r in run_ranks("tests.scenarios_verl:replica_peers", world=2,
                                            args={"delay_us": 1_500_000}, timeout=120)]
    for cycle_no in range(2):
        leader, peer = (r["cycles"][cycle_no] for r in ranks)
        assert leader["suspended"] == ["single_0"] and peer["suspended"] == ["single_1"]
        assert peer["freed_at"] - leader["freed_at"] > 1.0  # the peer really was slower
        assert leader["returned_at"] >= peer["freed_at"]


def test_an_unknown_group_in_keep_fails_at_the_first_weight_sync_naming_the_valid_ones():
    error = one_rank("unknown_keep_group")["error"]
    assert error and "unknown group name(s) ['nope'] in keep" in error
    assert "'dp'" in error and "'world'" in error and "name_group" in error


def test_the_first_begin_says_how_far_the_rollouts_share_of_the_gpu_can_go():
    """vLLM sizes its KV cache at start-up from gpu_memory_utilization: the worker
    logs, once, the value the freed memory allows (real verl config, fake 80 GiB GPU)."""
    for res in cycle(strategy="fsdp", early=True):
        session = res["session"]
        now, metrics = session["utilization_now"], session["metrics"]
        freed = metrics["amem/headroom/freed_bytes"]
        assert freed == metrics["amem/begin/nccl_bytes"] > 0
        expected = int((now + (freed - 512 * 2**20) / (80 * 2**30)) * 10**4) / 10**4
        assert metrics["amem/headroom/gpu_memory_utilization"] == max(now, expected)
        assert "actor_rollout_ref.rollout.gpu_memory_utilization" in session["headroom_line"]


# --- what Ray ships to the workers -------------------------------------------------
def test_the_worker_classes_ray_ships_pickle_with_the_wrappers_in_place():
    """Ray sends verl's colocated worker class by value, through its tracing wrappers,
    which copy our marker. The wrapped original then went by value too and verl's does
    not pickle: every verl job died at its first worker group, with and without
    ``amem.enable`` (an H100, session R). The marker pickles to an empty one now."""
    ray = pytest.importorskip("ray")
    from ray import cloudpickle
    from verl.single_controller.ray.base import RayClassWithInitArgs, create_colocated_worker_cls
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from amem_callbacks.patching import is_wrapped, original_of

    adapter.install()
    hooked = ("update_weights", "init_model", "amem_rollout_launching", "amem_rollout_ended",
              "amem_metrics")
    assert all(is_wrapped(ActorRolloutRefWorker.__dict__[name]) for name in hooked)
    worker = RayClassWithInitArgs(cls=ray.remote(ActorRolloutRefWorker), config=None,
                                  role="actor_rollout")
    shipped = create_colocated_worker_cls({"actor_rollout": worker}).cls
    for cls in (shipped, worker.cls):
        cloudpickle.loads(cloudpickle.dumps(cls.__ray_metadata__.modified_class))
    # the process that built the wrapper still finds its original
    assert original_of(ActorRolloutRefWorker.update_weights) is not None
    # what the package put on the class goes by reference: a by-value copy of an added
    # method would read the adapter's state as the driver had it (no session)
    for name in hooked:
        method = ActorRolloutRefWorker.__dict__[name]
        assert cloudpickle.loads(cloudpickle.dumps(method)) is method, name
