"""verl adapter on real NCCL: verl 0.9.1's own ActorRolloutRefWorker (FSDP2
engine) in plain torchrun processes, with and without
``actor_rollout_ref.rollout.custom.amem = {enable: true, backend: nccl}``.

Command (one run; tests/gpu/verl_gpu.sh runs baseline, amem and a control):
    python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/verl_gpu.py OUT.json \\
        [--amem nccl|noop|off] [--steps 4] [--baseline BASE.json] [--kv-mib N] [--cpu-smoke]
    python3 tests/gpu/verl_gpu.py summary SUMMARY.json BASE.json AMEM.json CONTROL.json

Needs NCCL >= 2.30 preloaded for several ranks on one GPU (LD_PRELOAD, and
NCCL_MULTI_RANK_GPU_ENABLE=1), and verl's wheels (tests/gpu/bundle_verl.sh):
    export PYTHONPATH=$PWD:/tmp/site:$PWD/tests/standins
(the repo first: verl's wheel also installs top-level ``tests`` and ``scripts``
packages; this script puts the repo and tests/standins first itself too).

What one run does, per rank, with no Ray actor and no driver: it builds a tiny
Qwen2 model and word-level tokenizer in code (rank 0 writes them to a temp
dir; nothing is downloaded), builds the worker from verl's own flattened PPO
config (``_generated_ppo_trainer.yaml``) with
``ActorRolloutRefWorker(config, role="actor_rollout")``, calls ``init_model``
once, then per step what verl's trainer and rollout replicas would make it do:
``update_weights`` (the rollout is a fake, registered in verl's rollout
registry, that consumes the weight generator and marks the moment a real
engine re-allocates its KV cache), ``rollout.release()`` and
``amem_rollout_ended()`` (the replicas sleep and the driver says rollout is
over), ``compute_log_prob`` on this rank's shard of the batch, and
``update_actor`` with those log-probs as the old ones.

Recorded per step: the three calls' times, the log-probs (all values, their
float64 sum and a SHA-256 of their bytes), update_actor's metrics, the GPU's
free bytes when the KV cache would come back (``resume(["kv_cache"])``: after
gc and a device sync, read between two store barriers so all ranks read the
same moment), and with amem what the adapter reports (groups suspended and
kept, NCCL suspendable bytes, the ``amem/...`` metrics from the worker's
``amem_metrics()`` and their driver-side merge, the guard's auto-resumes).
Rank 0 writes every rank's figures and named checks to OUT ("ok": all hold).
With ``--baseline`` the checks compare with that run: free bytes at the KV
cache higher by >= 90 % of the GPU-wide suspended NCCL bytes (the bytes of
every rank on rank 0's GPU, summed: on one GPU, all ranks'), log-probs and
update_actor's metrics identical.

Choices, and why:
- The device. verl's FSDP engine puts everything on
  ``verl.utils.device.get_device_id()``, i.e. ``torch.cuda.current_device()``,
  and never sets it on this path (it does only under Ray with
  RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES); torch's DeviceMesh keeps a device
  already set. So the script sets it first, GPU ``LOCAL_RANK % device_count``
  (tests/gpu/common.py bind_device), and sets LOCAL_RANK to that index for the
  one other reader, verl's NUMA-affinity lookup (an NVML device index).
- The process group. verl creates it (``cpu:gloo,cuda:nccl``) only if none
  exists; the script creates the same one first, with a short timeout, so a
  stuck collective fails instead of hanging. A watchdog (faulthandler) dumps
  every thread's stack and exits after ``--timeout-s``.
- Ray. verl imports ``ray`` but calls nothing of it here; the script always
  puts the test stand-in (tests/standins/ray, not Ray) first on sys.path,
  and the results say so.
- One configuration per process: the adapter decides at the worker's first
  ``update_weights`` whether it is on (verl's workers live as long as the
  job), and a second worker in the same process would add new device meshes,
  hence new communicators, beside the first one's. So baseline and amem are
  separate invocations, compared through ``--baseline``.
- Attention: the model runs on torch's SDPA (no flash-attn wheel), restricted
  to its math kernels (``--attention math``, the default) because the flash
  and memory-efficient backward passes are not deterministic, and the
  comparison with the baseline is exact. ``--attention default`` lifts that.
- trl next to verl (CI): verl 0.9.1's FSDP engine patches trl's
  ``AutoModelForCausalLMWithValueHead`` whenever trl is importable, and trl
  1.x no longer has it; the script then tells verl trl is absent (no value
  head is used here) and records that it did.

``--cpu-smoke`` runs the same plumbing on CPU over gloo with the noop backend
and a CPU "platform" for verl (tests/standins/verl_cpu_platform.py): a check
of the script, not a GPU proof (nothing is measured on a device).
``AMEM_GPU_DRIVER_ON_CPU=1`` (tests/gpu/common.py's CPU mode, what
tests/test_gpu_drivers_on_cpu.py runs) is the same with ``--amem nccl`` by
default and the fake NCCL of tests/fake_nccl behind the adapter's policy
(``make_policy``, the adapter's seam for that): groups are suspended and
resumed, and a collective on a suspended one ends the rank.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STANDINS = os.path.join(ROOT, "tests", "standins")
sys.path.insert(0, ROOT)
sys.path.insert(0, STANDINS)  # the ray stand-in wins over an installed Ray

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.gpu.common import ON_CPU, bind_device, cpu_notes, provenance, ranks_per_gpu, \
    stand_in_backend  # noqa: E402

SMOKE = "--cpu-smoke" in sys.argv or ON_CPU
FAKE_ROLLOUT = "amem_test_fake"  # the name our fake rollout is registered under
VOCAB_SPECIALS = ["<pad>", "<eos>", "<unk>"]
RESULT_KEY = "verl_gpu/result/"


def import_adapter():
    """amem_callbacks.adapters.verl from the installed package (a bare tree stops with
    the install command). Imported before verl: it only registers import hooks (an
    installed package does the same through its ``verl.plugins`` entry point)."""
    from tests.gpu.common import require_installed_package

    require_installed_package()
    import amem_callbacks.adapters.verl as adapter

    return adapter


ADAPTER = import_adapter()
if ON_CPU:
    def _policy_on_the_fake_nccl(settings, _make=ADAPTER.make_policy):
        """The adapter's own policy, its backend swapped for the fake NCCL."""
        from amem_callbacks import OffloadPolicy

        return OffloadPolicy(_make(settings).options.replace(backend=stand_in_backend()))

    ADAPTER.make_policy = _policy_on_the_fake_nccl


# --- small helpers ------------------------------------------------------------
def synchronize() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def now() -> float:
    synchronize()
    return time.perf_counter()


class Store:
    """Barriers and exchanges over the c10d store: they need no process group,
    so they are safe while NCCL groups are suspended and create no group the
    adapter would see."""

    def __init__(self, timeout_s: float):
        from torch.distributed import distributed_c10d as c10d

        self.store = c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self.rounds = 0

    def barrier(self, name: str) -> None:
        self.rounds += 1
        key = f"verl_gpu/barrier/{self.rounds}/{name}"
        self.store.add(key, 1)
        deadline = time.monotonic() + self.timeout_s
        while self.store.add(key, 0) < self.world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"store barrier {name!r}: not every rank arrived in "
                                   f"{self.timeout_s} s")
            time.sleep(0.002)

    def share(self, key: str, value=None):
        """Rank 0 sets ``value``; every rank gets it."""
        if self.rank == 0:
            self.store.set(key, json.dumps(value))
        return json.loads(self.store.get(key))


def digest(t: torch.Tensor, values: bool = True) -> dict:
    """Sum, SHA-256 of the bytes and (``values``) every value, exactly (float32 in JSON)."""
    t = t.detach().float().cpu().contiguous()
    out = {"sum": float(t.double().sum()), "shape": list(t.shape),
           "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()}
    if values:
        out["values"] = t.flatten().tolist()
    return out


def plain(value):
    """Metrics as JSON numbers (tensors, numpy scalars and lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if hasattr(value, "item"):
        return value.item()
    return value


# --- the model, built in code ---------------------------------------------------
def build_model(path: str, args) -> None:
    """A tiny Qwen2 causal LM and a word-level tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = VOCAB_SPECIALS + [f"w{i}" for i in range(args.vocab - len(VOCAB_SPECIALS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 4),
                         max_position_embeddings=4 * (args.prompt_len + args.response_len),
                         pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    Qwen2ForCausalLM(config).save_pretrained(path)


def model_dir(store: Store, args) -> str:
    """Rank 0 builds the model into a fresh temp dir; the others wait for its path."""
    path = None
    if store.rank == 0:
        path = tempfile.mkdtemp(prefix="amem-verl-gpu-")
        build_model(path, args)
    path = store.share("verl_gpu/model_dir", path)
    store.barrier("model built")
    return path


# --- the fake rollout -------------------------------------------------------------
class Probe:
    """What the fake rollout saw in the current step (filled in by it)."""

    def __init__(self):
        self.store: Store = None
        self.kv_bytes = 0
        self.step: dict = {}
        self.events: list = []

    def at_kv_cache(self) -> dict:
        """GPU free bytes at the moment the KV cache comes back, all ranks at once."""
        gc.collect()
        synchronize()
        self.store.barrier("kv_cache read")
        reading = {"free": None, "total": None, "reserved": None, "allocated": None}
        if not SMOKE:
            free, total = torch.cuda.mem_get_info()
            reading = {"free": free, "total": total, "reserved": torch.cuda.memory_reserved(),
                       "allocated": torch.cuda.memory_allocated()}
        self.store.barrier("kv_cache read done")  # nobody allocates before all have read
        return reading


PROBE = Probe()


def register_fake_rollout():
    """Put the fake rollout into verl's registry (read when init_model builds the rollout)."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.base import BaseRollout

    class FakeRollout(BaseRollout):
        """Stands in for the rollout server adapter: takes the weights, marks the
        KV-cache moment, optionally holds a dummy KV tensor until ``release``."""

        def __init__(self, config, model_config, device_mesh, *args, **kwargs):
            super().__init__(config, model_config, device_mesh)
            self.kv = None

        async def resume(self, tags):
            PROBE.events.append(["resume", list(tags)])
            if "kv_cache" in tags:
                PROBE.step["at_kv_cache"] = PROBE.at_kv_cache()
                if PROBE.kv_bytes and not SMOKE:
                    self.kv = torch.empty(PROBE.kv_bytes, dtype=torch.uint8, device="cuda")
                    self.kv.fill_(1)
                    synchronize()

        async def update_weights(self, weights, wire_format="named_tensors", **kwargs):
            count, numel, total = 0, 0, 0.0
            for _name, tensor in weights:  # gathers the FSDP shards: collectives
                count += 1
                numel += tensor.numel()
                total += float(tensor.detach().double().sum())
            PROBE.step["weights"] = {"tensors": count, "numel": numel, "sum": total,
                                     "global_steps": kwargs.get("global_steps")}
            PROBE.events.append(["update_weights", count])

        async def release(self):
            PROBE.events.append(["release"])
            self.kv = None

    globals()["FakeRollout"] = FakeRollout
    rollout_base._ROLLOUT_REGISTRY[(FAKE_ROLLOUT, "async")] = f"{__name__}.FakeRollout"


# --- verl ---------------------------------------------------------------------------
def skip_trl_value_head_patch() -> bool:
    """verl 0.9.1's FSDP engine imports trl's AutoModelForCausalLMWithValueHead
    whenever trl is importable; trl >= 1.0 has no such class. No value head is
    used here: tell verl trl is absent. Returns whether it had to."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return False
    try:
        from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
        return False
    except ImportError:
        try:
            from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
            return False
        except ImportError:
            pass
    from verl.models.transformers import monkey_patch

    monkey_patch.is_trl_available = lambda: False
    return True


def make_config(args, path: str):
    """actor_rollout_ref from verl's flattened PPO config, for this tiny job."""
    import verl
    from omegaconf import OmegaConf, open_dict

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                      "_generated_ppo_trainer.yaml"))
    ar = cfg.actor_rollout_ref
    with open_dict(cfg):
        ar.model.path = path
        ar.model.use_remove_padding = args.remove_padding
        ar.model.enable_gradient_checkpointing = False
        ar.model.override_config = {"attn_implementation": "sdpa"}  # no flash-attn wheel
        ar.actor.strategy = "fsdp2"
        ar.actor.fsdp_config.strategy = "fsdp2"
        ar.actor.use_torch_compile = False
        ar.actor.fsdp_config.use_torch_compile = False
        ar.actor.ppo_mini_batch_size = args.batch
        ar.actor.ppo_micro_batch_size_per_gpu = args.micro_batch
        ar.actor.use_dynamic_bsz = False
        ar.actor.shuffle = False
        ar.actor.optim.lr = 1e-5
        ar.rollout.name = FAKE_ROLLOUT
        ar.rollout.n = 1
        ar.rollout.log_prob_micro_batch_size_per_gpu = args.micro_batch
        ar.rollout.log_prob_use_dynamic_bsz = False
        ar.rollout.tensor_model_parallel_size = args.rollout_tp  # verl builds its infer_tp mesh
        ar.rollout.checkpoint_engine.backend = "naive"  # colocated: the adapter's case
        ar.rollout.free_cache_engine = True
        ar.ref.fsdp_config.strategy = "fsdp2"
        if args.amem != "off":
            ar.rollout.custom = {"amem": {"enable": True, "backend": args.amem}}
    return ar


def batch(args, step: int, world: int, rank: int):
    """This rank's shard of a padded PPO batch (left-padded prompts, right-padded
    responses), the same in every run: seeded by the step."""
    from verl import DataProto

    g = torch.Generator().manual_seed(1000 + step)
    b, p, r = args.batch, args.prompt_len, args.response_len
    prompts = torch.randint(len(VOCAB_SPECIALS), args.vocab, (b, p), generator=g)
    responses = torch.randint(len(VOCAB_SPECIALS), args.vocab, (b, r), generator=g)
    prompt_len = torch.randint(p // 2, p + 1, (b,), generator=g)
    response_len = torch.randint(r // 2, r + 1, (b,), generator=g)
    prompt_mask = (torch.arange(p)[None, :] >= (p - prompt_len)[:, None]).long()
    response_mask = (torch.arange(r)[None, :] < response_len[:, None]).long()
    prompts = torch.where(prompt_mask.bool(), prompts, 0)
    responses = torch.where(response_mask.bool(), responses, 0)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.randn(b, r, generator=g) * response_mask
    data = DataProto.from_single_dict(
        {"input_ids": torch.cat([prompts, responses], dim=1), "prompts": prompts,
         "responses": responses, "attention_mask": attention_mask,
         "position_ids": position_ids, "response_mask": response_mask,
         "advantages": advantages},
        meta_info={"temperature": 1.0})
    return data.chunk(world)[rank]  # what the "actor" mesh dispatch sends this dp rank


def log_prob_input(shard):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(shard.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
    return td


def update_input(shard, old_log_probs, args):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    shard.batch["old_log_probs"] = old_log_probs.float()
    td = left_right_2_no_padding(shard.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False,
                         distillation_only=False, global_batch_size=args.batch,
                         mini_batch_size=args.batch, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    return td


# --- what the adapter reports -----------------------------------------------------------
def begin_report(report) -> dict:
    if report is None:
        return {}
    from amem_callbacks.states import Outcome

    return {"suspended": {g.name: g.suspendable_bytes or 0 for g in report.suspended},
            "would_suspend": [g.name for g in report.groups if g.action == Outcome.WOULD_SUSPEND],
            "kept": {g.name: g.reason for g in report.kept},
            "failed": {g.name: g.error for g in report.failed},
            "nccl_bytes": report.nccl_bytes, "device_freed_bytes": report.device_freed_bytes,
            "ranks_on_gpu": report.device_shared_by, "seconds": report.total_seconds,
            "wall_seconds": report.wall_seconds, "skipped": report.skipped,
            "summary": report.summary()}


def end_report(report) -> dict:
    if report is None:
        return {}
    from amem_callbacks.states import Outcome

    return {"resumed": [g.name for g in report.groups if g.action == Outcome.RESUMED],
            "nccl_bytes": report.nccl_bytes, "seconds": report.total_seconds,
            "wall_seconds": report.wall_seconds, "skipped": report.skipped,
            "summary": report.summary()}


def session_reports() -> tuple:
    session = ADAPTER.current_session()
    if session is None:
        return None, None
    reports = session.reports
    return reports.get("begin"), reports.get("end")


# --- one run ---------------------------------------------------------------------------------
def run(args, store: Store) -> dict:
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import no_padding_2_padding

    rank, world = store.rank, store.world
    out = {"rank": rank, "steps": [], "events": PROBE.events}
    path = model_dir(store, args)
    out["trl_value_head_patch_skipped"] = skip_trl_value_head_patch()
    register_fake_rollout()
    config = make_config(args, path)
    torch.manual_seed(0)
    started = now()
    worker = ActorRolloutRefWorker(config=config, role="actor_rollout")
    worker.init_model()
    out["init_model_s"] = now() - started
    out["device"] = None if SMOKE else torch.cuda.current_device()
    if not SMOKE:
        from amem_callbacks.placement import device_id

        out["device_uuid"] = device_id(out["device"])  # ranks on one GPU share its figures
    PROBE.store, PROBE.kv_bytes = store, args.kv_mib << 20
    for step in range(1, args.steps + 1):
        PROBE.step = record = {"step": step}
        shard = batch(args, step, world, rank)

        t0 = now()
        asyncio.run(worker.update_weights(global_steps=step))
        t1 = now()
        begin, _ = session_reports()
        record["amem_begin"] = begin_report(begin)
        # The replicas sleep, then the driver's sleep_replicas says rollout is over.
        asyncio.run(worker.rollout.release())
        record["rollout_ended_signal"] = worker.amem_rollout_ended() if args.rollout_ended \
            else None
        t2 = now()

        td = log_prob_input(shard)
        output = worker.compute_log_prob(td)
        t3 = now()
        _, end = session_reports()
        record["amem_end"] = end_report(end)
        log_probs = no_padding_2_padding(tu.get(output, "log_probs"), td)
        entropy = no_padding_2_padding(tu.get(output, "entropy"), td)
        record["log_probs"] = digest(log_probs)
        record["entropy"] = digest(entropy, values=False)

        output = worker.update_actor(update_input(shard, log_probs, args))
        t4 = now()
        record["metrics"] = plain(tu.get(output, "metrics"))
        record["seconds"] = {"update_weights": t1 - t0, "release_and_signal": t2 - t1,
                             "compute_log_prob": t3 - t2, "update_actor": t4 - t3,
                             "step": t4 - t0}
        record["amem_metrics"] = worker.amem_metrics()
        out["steps"].append(record)
        if rank == 0:
            print(f"[verl_gpu] step {step}: {json.dumps(record['seconds'])} "
                  f"free at kv_cache {record.get('at_kv_cache', {}).get('free')} "
                  f"{record['amem_begin'].get('summary', '')}", flush=True)

    session = ADAPTER.current_session()
    out["amem_session"] = session is not None
    if session is not None:
        from tests.gpu.common import nccl_library

        policy = session.policy
        totals = policy.metrics(last=False)
        out["amem_counters"] = totals
        inert = bool(totals["amem/inert"])
        # the backend as the last begin report names it; when every begin did nothing
        # (inert: none is in the session's history), wait() gives the last report, which
        # says why; and the NCCL the backend calls
        report = session.last_begin or policy.wait()
        lib = nccl_library()
        out["amem_backend"] = {
            "name": getattr(report, "backend", None), "inert": inert,
            "why_inert": report.skipped if inert and report is not None else None,
            "nccl": f"NCCL {lib.version_str} from {lib.path}" if lib else None}
        out["amem_learned"] = {k: v for k, v in totals.items() if k.startswith("amem/learned/")}
    out["weights_per_step"] = [s.get("weights") for s in out["steps"]]
    store.barrier("steps done")
    if rank == 0:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    return out


# --- checks -------------------------------------------------------------------------------
def median_step(ranks: list) -> float:
    """Median over steps 2..N of the slowest rank's step time."""
    steps = [max(r["steps"][i]["seconds"]["step"] for r in ranks)
             for i in range(len(ranks[0]["steps"]))]
    tail = steps[1:] or steps
    return statistics.median(tail)


def compare(ranks: list, base_ranks: list) -> dict:
    """Per step and rank: identical log-probs and update_actor metrics? and how far apart."""
    same_lp, same_metrics, max_diff, metric_diff = True, True, 0.0, 0.0
    for r, b in zip(ranks, base_ranks):
        for s, t in zip(r["steps"], b["steps"]):
            same_lp &= s["log_probs"]["sha256"] == t["log_probs"]["sha256"]
            max_diff = max([max_diff] + [abs(x - y) for x, y in
                                         zip(s["log_probs"]["values"], t["log_probs"]["values"])])
            for key, value in s["metrics"].items():
                other = t["metrics"].get(key)
                if "mfu" in key or "time" in key or "perf" in key:
                    continue  # throughput figures, not results
                same_metrics &= value == other
                a = value if isinstance(value, list) else [value]
                c = other if isinstance(other, list) else [other]
                for x, y in zip(a, c):
                    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                        metric_diff = max(metric_diff, abs(x - y))
    return {"log_probs_identical": same_lp, "metrics_identical": same_metrics,
            "log_probs_max_abs_diff": max_diff, "metrics_max_abs_diff": metric_diff}


def checks_for(summary: dict, args, base: Optional[dict] = None) -> dict:
    ranks = summary["ranks"]
    steps = args.steps
    checks = {"every_step_ran": all(len(r["steps"]) == steps for r in ranks),
              "weights_reached_the_rollout": all(
                  w and w["tensors"] > 0 for r in ranks for w in r["weights_per_step"])}
    on = args.amem != "off"
    checks["adapter_session_iff_enabled"] = all(r["amem_session"] == on for r in ranks)
    if on:
        counters = [r["amem_counters"] for r in ranks]
        checks["one_begin_and_end_per_step"] = all(
            c["amem/total/begins"] == c["amem/total/ends"] == steps for c in counters)
        checks["no_collective_on_a_suspended_group"] = all(
            c["amem/total/auto_resumes"] == 0 for c in counters)
        checks["no_failures"] = all(c["amem/total/failures"] == 0 for c in counters)
        checks["backend_active"] = all(not r["amem_backend"]["inert"] for r in ranks)
        if args.amem == "noop":
            checks["groups_would_be_suspended_every_step"] = all(
                s["amem_begin"].get("would_suspend") for r in ranks for s in r["steps"])
        else:
            checks["groups_suspended_every_step"] = all(
                s["amem_begin"].get("suspended") for r in ranks for s in r["steps"])
            checks["every_suspended_group_resumed"] = all(
                sorted(s["amem_begin"]["suspended"]) == sorted(s["amem_end"].get("resumed", []))
                for r in ranks for s in r["steps"])
        checks["amem_metrics_from_every_rank"] = all(
            s["amem_metrics"].get("amem/total/begins") == s["step"]
            for r in ranks for s in r["steps"])
    if base is None:
        return checks
    base_ranks = base["ranks"]
    comparison = compare(ranks, base_ranks)
    summary["vs_baseline"] = comparison
    checks["log_probs_identical_to_baseline"] = comparison["log_probs_identical"]
    checks["update_actor_metrics_identical_to_baseline"] = comparison["metrics_identical"]
    checks["weights_identical_to_baseline"] = all(
        w["sum"] == v["sum"] for r, b in zip(ranks, base_ranks)
        for w, v in zip(r["weights_per_step"], b["weights_per_step"]))
    mine, base_median = median_step(ranks), median_step(base_ranks)
    summary["step_time"] = {"median_s": mine, "baseline_median_s": base_median,
                            "added_s": mine - base_median, "ratio": mine / base_median}
    memory = []
    for i in range(steps):
        free = ranks[0]["steps"][i].get("at_kv_cache", {}).get("free")
        base_free = base_ranks[0]["steps"][i].get("at_kv_cache", {}).get("free")
        # rank 0 read its GPU's free bytes: count the NCCL bytes of every rank on that GPU
        same_gpu = [r for r in ranks if r.get("device_uuid") == ranks[0].get("device_uuid")]
        suspended = sum(r["steps"][i]["amem_begin"].get("nccl_bytes", 0) for r in same_gpu) \
            if on else 0
        gain = None if free is None or base_free is None else free - base_free
        memory.append({"step": i + 1, "free_at_kv_cache": free, "baseline_free": base_free,
                       "gain_vs_baseline": gain, "gpu_suspended_nccl_bytes": suspended,
                       "gain_over_suspended": gain / suspended if gain is not None and suspended
                       else None})
    summary["memory"] = memory
    if SMOKE:
        summary["memory_note"] = "--cpu-smoke: no device memory is measured; no memory check"
    elif on and args.amem != "noop":
        checks["free_at_kv_cache_gain_ge_90pct_of_gpu_suspended_bytes"] = all(
            m["gpu_suspended_nccl_bytes"] > 0 and m["gain_vs_baseline"] >= 0.9 *
            m["gpu_suspended_nccl_bytes"] for m in memory)
    return checks


# --- the wrapper's summary ----------------------------------------------------------------
def summarize(out_path: str, base_path: str, amem_path: str, control_path: str) -> int:
    """Baseline, amem and control runs in one verdict (no torch.distributed needed)."""
    runs = {}
    for name, path in (("baseline", base_path), ("amem", amem_path), ("control", control_path)):
        try:
            with open(path) as f:
                runs[name] = json.load(f)
        except (OSError, ValueError) as exc:
            runs[name] = {"ok": False, "missing": f"{path}: {exc}"}
    amem, control = runs["amem"], runs["control"]
    deterministic = bool(control.get("vs_baseline", {}).get("log_probs_identical")
                         and control.get("vs_baseline", {}).get("metrics_identical"))
    out = {"ok": all(r.get("ok") for r in runs.values()),
           "runs": {n: {"ok": r.get("ok"), "failed": [k for k, v in r.get("checks", {}).items()
                                                      if v is False],
                        "missing": r.get("missing"), "command": r.get("command"),
                        "commit": r.get("commit")} for n, r in runs.items()},
           "deterministic_baseline": deterministic,
           # tests/gpu/verl_gpu.sh names its own command line (AMEM_RUN_COMMAND)
           **provenance("tests/gpu/verl_gpu.py")}
    if not deterministic and "vs_baseline" in control and "vs_baseline" in amem:
        # The baseline does not repeat itself: judge amem by the control's spread.
        tol = control["vs_baseline"]
        out["tolerance_from_control"] = tol
        out["amem_within_control_spread"] = (
            amem["vs_baseline"]["log_probs_max_abs_diff"] <= tol["log_probs_max_abs_diff"]
            and amem["vs_baseline"]["metrics_max_abs_diff"] <= tol["metrics_max_abs_diff"])
    for key in ("vs_baseline", "memory", "step_time"):
        out[f"amem_{key}"] = amem.get(key)
        out[f"control_{key}"] = control.get(key)
    for key in ("versions", "device", "ranks_per_gpu", "ray"):
        out[key] = runs["baseline"].get(key, amem.get(key))
    exits = os.path.join(os.path.dirname(os.path.abspath(out_path)), "exits.txt")
    if os.path.exists(exits):  # written by tests/gpu/verl_gpu.sh
        with open(exits) as f:
            out["exit_codes"] = f.read().split("\n")[:-1]
        out["ok"] = out["ok"] and all(line.endswith(" 0") for line in out["exit_codes"])
    first = (amem.get("ranks") or [{}])[0]
    out["amem_suspended_first_step"] = (first.get("steps") or [{}])[0].get("amem_begin")
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(json.dumps({k: out[k] for k in ("ok", "runs", "deterministic_baseline")}, default=str))
    print("OK" if out["ok"] else "FAILED")
    return 0 if out["ok"] else 1


# --- main -------------------------------------------------------------------------------------
def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--amem", choices=("nccl", "noop", "off"),
                        default="noop" if SMOKE and not ON_CPU else "nccl")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--baseline", help="a run's OUT.json to compare with")
    parser.add_argument("--kv-mib", type=int, default=0,
                        help="dummy KV cache the fake rollout holds from resume to release")
    parser.add_argument("--no-rollout-ended", dest="rollout_ended", action="store_false",
                        help="skip the driver's end-of-rollout signal (resume at compute_log_prob)")
    parser.add_argument("--remove-padding", action="store_true")
    parser.add_argument("--attention", choices=("math", "default"), default="math",
                        help="SDPA kernels: math (deterministic, the default) or torch's choice")
    parser.add_argument("--rollout-tp", type=int, default=1,
                        help="rollout tensor parallel size (verl's rollout mesh; the fake rollout "
                             "itself runs no collective)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--cpu-smoke", action="store_true")
    small = SMOKE
    parser.add_argument("--batch", type=int, default=8 if small else 16)
    parser.add_argument("--micro-batch", type=int, default=2 if small else 4)
    parser.add_argument("--prompt-len", type=int, default=16 if small else 256)
    parser.add_argument("--response-len", type=int, default=8 if small else 256)
    parser.add_argument("--vocab", type=int, default=128 if small else 8192)
    parser.add_argument("--hidden", type=int, default=64 if small else 1024)
    parser.add_argument("--layers", type=int, default=2 if small else 8)
    parser.add_argument("--heads", type=int, default=4 if small else 16)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def versions() -> dict:
    import transformers
    import verl

    out = {"verl": verl.__version__, "torch": torch.__version__,
           "transformers": transformers.__version__, "python": sys.version.split()[0]}
    try:
        import tensordict

        out["tensordict"] = tensordict.__version__
    except ImportError:
        pass
    if not SMOKE:
        v = torch.cuda.nccl.version()
        out["nccl_torch_reports"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        from amem_callbacks.nccl_library import NcclLibrary

        lib = NcclLibrary.loaded()
        out["nccl_loaded"] = lib.version_str if lib else None
        out["nccl_path"] = lib.path if lib else None
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "summary":
        return summarize(*sys.argv[2:6])
    args = parse()
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)  # no hang: stacks, then exit
    timeout = timedelta(seconds=min(args.timeout_s, 180.0))
    if SMOKE:
        import verl_cpu_platform  # tests/standins: CPU-only scaffolding

        verl_cpu_platform.install()
        dist.init_process_group("gloo", timeout=timeout)
    else:
        os.environ["LOCAL_RANK"] = str(bind_device())  # LOCAL_RANK % GPUs; see the docstring
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)  # what verl would make
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.attention == "math" and not SMOKE:  # flash/efficient SDPA backward is not deterministic
        for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
            if hasattr(torch.backends.cuda, name):
                getattr(torch.backends.cuda, name)(False)
    store = Store(timeout_s=min(args.timeout_s, 180.0))
    result = run(args, store)
    import ray

    store.store.set(f"{RESULT_KEY}{store.rank}", json.dumps(result, default=str))
    store.barrier("results written")
    if store.rank == 0:
        ranks = [json.loads(store.store.get(f"{RESULT_KEY}{r}")) for r in range(store.world)]
        summary = {**provenance("tests/gpu/verl_gpu.py"),
                   "mode": "cpu-smoke (gloo, noop; not a GPU proof)" if SMOKE else "gpu",
                   "amem": args.amem, "args": vars(args), "versions": versions(),
                   "device": None if SMOKE else torch.cuda.get_device_name(),
                   "ranks_per_gpu": None if SMOKE else ranks_per_gpu(),
                   "ray": getattr(ray, "STANDIN", f"ray {getattr(ray, '__version__', '?')}"),
                   "ray_standin_calls": getattr(ray, "USED", None),
                   "driver_merged_amem_metrics": ADAPTER.merge_rank_metrics(
                       [r["steps"][-1]["amem_metrics"] for r in ranks]),
                   "ranks": ranks, **cpu_notes()}
        base, unreadable = None, None
        if args.baseline:
            try:
                with open(args.baseline) as f:
                    base = json.load(f)
            except (OSError, ValueError) as exc:
                unreadable = f"{args.baseline}: {exc}"
        summary["checks"] = checks_for(summary, args, base)
        if unreadable:  # the baseline run failed: nothing to compare with
            summary["checks"]["baseline_readable"] = False
            summary["baseline_error"] = unreadable
        summary["ok"] = all(v is not False for v in summary["checks"].values())
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1, default=str)
        failed = [k for k, v in summary["checks"].items() if v is False]
        print(f"[verl_gpu] amem={args.amem} step time {summary.get('step_time')} "
              f"failed checks: {failed}", flush=True)
        print("OK" if summary["ok"] else "FAILED", flush=True)
    store.barrier("summary written")
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
