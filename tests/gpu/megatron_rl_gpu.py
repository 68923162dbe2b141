"""Megatron-LM's own RL loop (``train_rl.py``, ``megatron.rl``, in-process
inference through ``DynamicInferenceEngine``) on megatron-core 0.19.2, run with
and without ``--rl-amem-offload-during-rollout``.

This file wraps ``train_rl.py`` and changes nothing in its loop. Before
handing over to it, it:

- makes a tiny tokenizer in code and an agent config;
- points rank 0's servers at 127.0.0.1;
- maps ``LOCAL_RANK`` to the shared GPU;
- records what the comparison needs:
  - each iteration's loss dict and times;
  - the free device memory at each KV-cache allocation (the launch, every
    rollout's resume, and with ``--rl-amem-grow-kv-cache`` a regrow mid-rollout),
    with what the package had freed by then;
  - every engine step: its times, tokens, and how full the engine was;
  - what the amem controller did (its KV growth decisions and figures included).

Each rank writes ``PREFIX.rankN.json`` just before Megatron's shutdown hard-exits
the process. ``--merge`` compares the runs.

Test stand-ins (they live in ``tests/standins``; the results name them):

- ``flash_attn``, pure PyTorch, for the engine's paged attention;
- ``megatron_thd_spec``, for training's packed-sequence attention without
  Transformer Engine;
- ``wandb``, for an annotation;
- the reward-only agent ``tests/gpu/megatron_rl_agent.py``.

With amem (the launcher takes the ``--rl-amem-*`` flags and runs this file)::

    torchrun --nproc-per-node 2 -m amem_callbacks.adapters.megatron \\
        tests/gpu/megatron_rl_gpu.py --probe-out OUT/amem --mlm .gpu/megatron/mlm \\
        --rl-amem-offload-during-rollout --rl-amem-backend nccl

Without it: the same command with ``tests/gpu/megatron_rl_gpu.py`` as the script
and no ``--rl-amem-*`` flags. Any other flag goes to ``train_rl.py`` and
overrides the tiny defaults below. The whole set (bundle, baseline, amem,
control run, merge) is in ``tests/gpu/megatron_rl_gpu.sh``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import statistics
import sys
import time

from amem_callbacks.patching import Patches, wrapper

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STANDINS = os.path.join(ROOT, "tests", "standins")
AGENT = ("AmemCountingAgent", "tests.gpu.megatron_rl_agent:CountingAgent")
LOOPBACK = "127.0.0.1"

# A tiny GPT that Megatron builds in process (random weights), GRPO with
# 2 prompts x 2 samples per step: one rollout per iteration.
TINY = """
--perform-rl-step --rl-kv-cache-management-mode recompute
--num-layers 2 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4
--seq-length 128 --max-position-embeddings 128 --inference-max-seq-length 128
--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
--micro-batch-size 1 --global-batch-size 4
--grpo-prompts-per-step 2 --grpo-group-size 2 --grpo-iterations 1
--train-iters 4 --eval-iters 0 --eval-interval 1000 --log-interval 1
--lr 1e-6 --bf16 --seed 1234
--transformer-impl local --spec megatron_thd_spec local_thd_spec
--no-rope-fusion --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm
--inference-dynamic-batching-buffer-size-gb 2 --cuda-graph-impl none
""".split()

_patches = Patches()  # test-side wrappers around Megatron (the loop itself is untouched)


def new_record() -> dict:
    """What a rank records, empty (one per process; tests start one per simulated run).
    ``started``: the clock where a whole-run figure starts (this module's import, before
    Megatron, the model and the first rollout's warm-up)."""
    return {"iterations": [], "rollouts": [], "kv_cache_allocations": [], "errors": [],
            "generations": [], "events": [], "memory_trace": [], "engine_steps": [],
            "started": time.monotonic()}


_record = new_record()


# --- set-up before Megatron is imported ----------------------------------
def share_the_gpu() -> None:
    """Megatron sets ``cuda:LOCAL_RANK``: fold it onto the GPUs that exist."""
    from amem_callbacks.tools.launch import local_device

    local = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["LOCAL_RANK"] = str(local_device(local))
    _record["local_rank"], _record["device"] = local, int(os.environ["LOCAL_RANK"])


def add_sources(mlm: str) -> None:
    """``megatron.rl``/``megatron.inference`` and train_rl's helpers come from
    the Megatron-LM tree, ``megatron.core``/``megatron.training`` from the
    wheel: ``megatron`` is a namespace package in both, so the two merge."""
    for path in (mlm, STANDINS, ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(   # for the spawned coordinator
        [mlm, STANDINS, ROOT, os.environ.get("PYTHONPATH", "")])


def make_tokenizer(path: str, size: int = 0) -> str:
    """A one-character-per-token HF tokenizer with a chat template, no download.
    Each rank writes its own copy (no cross-rank file race). ``size`` pads the
    vocabulary with unused tokens: a random model then rarely samples the end
    token, so generations run to their length cap (a KV-bound rollout)."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = specials + [chr(c) for c in range(32, 127)]
    words += [f"<unused{i}>" for i in range(max(0, size - len(words)))]
    vocab = {t: i for i, t in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    tokenizer.save_pretrained(path)
    return path


def write_env_config(path: str) -> str:
    with open(path, "w") as f:
        f.write(f"- agent_type: {AGENT[0]}\n  agent_args: {{}}\n  weight: 1.0\n")
    return path


# --- test-side patches (the loop itself is untouched) ----------------------
def with_loopback(original, *args, hostname=None, **kwargs):
    return original(*args, hostname=hostname or LOOPBACK, **kwargs)


def keep_servers_local() -> None:
    """Rank 0's ZMQ coordinator and HTTP front end bind ``gethostname()`` and
    0.0.0.0, and 0.19 has no flag for either: pass 127.0.0.1 where it takes one."""
    from megatron.core.inference.engines import dynamic_engine
    from megatron.core.inference.text_generation_server import dynamic_text_gen_server as server
    from megatron.rl.inference.megatron import MegatronLocal

    _patches.wrap(dynamic_engine.DynamicInferenceEngine,
                  "start_listening_to_data_parallel_coordinator", with_loopback, required=True)
    # launch() imports it at call time, so the module attribute is what it gets
    _patches.wrap(server, "start_text_gen_server", with_loopback, required=True)
    _patches.wrap(MegatronLocal, "launch", required=True, replace=lambda original: classmethod(
        wrapper(original.__func__, lambda launch, cls, model, **kwargs:
                launch(cls, model, **{**kwargs, "host": LOOPBACK, **_server_port()}))))


def _server_port() -> dict:
    """Concurrent runs on one machine each need their own HTTP front-end port
    (0.19 hard-codes 8294); the runner passes one in AMEM_TEXT_GEN_PORT."""
    port = os.environ.get("AMEM_TEXT_GEN_PORT")
    return {"port": int(port)} if port else {}


def register_agent() -> None:
    from megatron.rl.agent import registry

    registry.AGENT_REGISTRY[AGENT[0]] = AGENT[1]


#: the fields of each ``engine_steps`` row (one per engine step, every rank)
STEP_FIELDS = ("began", "ended", "tokens", "active", "paused", "waiting", "max_requests",
               "blocks", "free_blocks")


def _iteration() -> int:
    from megatron.training.global_vars import get_args
    return getattr(get_args(), "curr_iteration", -1)


def _device_memory() -> tuple:
    """(free, total, torch reserved) bytes of this rank's device, after a sync."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return free, total, torch.cuda.memory_reserved()


def _amem_freed() -> dict:
    """What the package's running begin has freed on this rank so far (its own
    account, never blocking), for comparing free memory at a KV allocation; empty
    without the package."""
    controller = _controller()
    session = getattr(controller, "session", None) if controller is not None else None
    if session is None or not controller.active:
        return {}
    freed = session.freed()
    return {"amem_freed_bytes": freed.nbytes, "amem_suspends_done": freed.done}


def kv_alloc(context, *args, **kwargs) -> None:
    """Before ``initialize_all_tensors``: the free memory the allocation finds. In
    recompute mode it runs at the launch, at every rollout's resume and at a regrow
    mid-rollout (the engine's own suspend and resume), so one rollout may hold two."""
    if not context.is_tensor_state_allocated:
        free, total, reserved = _device_memory()
        _record["kv_cache_allocations"].append(
            {"iteration": _iteration(), "at": time.monotonic(), "free_bytes": free,
             "total_bytes": total, "torch_reserved_bytes": reserved,
             "rollout_active": _amem_active(), **_amem_freed()})


def kv_allocated(result, context, *args, **kwargs) -> None:
    """After it: the cache's size, blocks and the requests it runs at once."""
    allocation = _record["kv_cache_allocations"][-1] if _record["kv_cache_allocations"] \
        else None
    buffer = getattr(context, "memory_buffer", None)
    if allocation is not None and "kv_bytes" not in allocation and buffer is not None:
        allocator = getattr(context, "kv_block_allocator", None)
        allocation.update(kv_bytes=buffer.numel() * buffer.element_size(),
                          blocks=getattr(allocator, "total_count", None),
                          block_tokens=getattr(context, "block_size_tokens", None),
                          max_requests=getattr(context, "max_requests", None),
                          allocated_at=time.monotonic())
        mark("kv_allocated")


def rollouts_probe(inner, stop_after: int = 0, prefix: str = ""):
    """``get_environment_rollouts`` timed and counted; with ``stop_after``, the
    process writes its record and exits once that many rollouts are back (a run
    that needs no training after them: every rank holds the rollouts then)."""
    def generated(*args, **kwargs):
        mark("rollouts_asked")
        start = time.monotonic()
        result = inner(*args, **kwargs)
        seconds = time.monotonic() - start
        tokens, evictions, count = _count_tokens(result)
        _record["generations"].append({"iteration": _iteration(), "start": start,
                                       "seconds": seconds, "generated_tokens": tokens,
                                       "rollouts": count, "evictions": evictions})
        mark("rollouts_back")
        if stop_after and len(_record["generations"]) >= stop_after:
            write_record(prefix)
            _exit(0)
        return result
    return generated


def _exit(code: int) -> None:
    os._exit(code)  # Megatron's own shutdown ends so too; rank 0's servers die with the run


def probe_engine_steps(engine_cls) -> None:
    """Every engine step (``async_step``, the boundary the package also wraps), on
    every rank: its times, the tokens it produced and how full the engine was. A
    plain function, not a marked wrapper: the package's hook wraps this method too
    and refuses a marked one (either may come first)."""
    inner = engine_cls.async_step

    async def async_step(self, *args, **kwargs):
        began = time.monotonic()
        result = await inner(self, *args, **kwargs)
        record_step(self, began, time.monotonic(), result)
        return result

    async_step.__wrapped__ = inner
    engine_cls.async_step = async_step


def record_step(engine, began: float, ended: float, result) -> None:
    """One ``engine_steps`` row (STEP_FIELDS). Tokens are counted as the package's
    meter counts them (a token per request that ran: the step's still-active and
    finished requests), written here so that a run without the package imports none
    of it; a CPU test keeps the two equal."""
    context = engine.context
    tokens = 0
    if isinstance(result, dict):
        tokens = len(result.get("active_request_ids") or ()) + len(
            result.get("finished_request_records") or ())
    total = getattr(context, "total_request_count", 0)
    paused = getattr(context, "paused_request_count", 0)
    allocator = getattr(context, "kv_block_allocator", None)
    _record["engine_steps"].append(
        [began, ended, tokens, total - paused, paused,
         len(getattr(engine, "waiting_request_ids", ()) or ()),
         getattr(context, "max_requests", 0), getattr(allocator, "total_count", 0),
         getattr(allocator, "total_avail", 0)])


def _timed(original, *args, **kwargs):
    start = time.monotonic()
    result = original(*args, **kwargs)
    return result, start, time.monotonic() - start


def rollout(original, *args, **kwargs):
    result, start, seconds = _timed(original, *args, **kwargs)
    _record["rollouts"].append({"iteration": _iteration(), "start": start, "seconds": seconds})
    return result


def train_step(original, *args, **kwargs):
    result, _, seconds = _timed(original, *args, **kwargs)
    _record.setdefault("train_step_seconds", []).append(seconds)
    return result


def training_log(loss_dict, total_loss_dict, learning_rate, iteration_, *args, **kwargs):
    _record["iterations"].append({
        "iteration": iteration_, "time": time.monotonic(),
        "loss": {k: _number(v) for k, v in loss_dict.items()},
        # training_log(loss_dict, total, lr, iteration, loss_scale, report_memory_flag,
        #              skipped_iter, grad_norm, ...)
        "grad_norm": _number(args[3] if len(args) > 3 else kwargs.get("grad_norm"))})


def install_probes(prefix: str, stop_after: int = 0) -> None:
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.rl import rl_utils
    from megatron.training import training

    _record["engine_step_fields"] = list(STEP_FIELDS)
    _patches.wrap(DynamicInferenceContext, "initialize_all_tensors", before=kv_alloc,
                  after=kv_allocated, required=True)
    # The adapter wraps this function too (its early begin): Patches refuses a second
    # wrapper of one attribute, so the probe goes around whatever is there.
    rl_utils.get_environment_rollouts = rollouts_probe(rl_utils.get_environment_rollouts,
                                                       stop_after, prefix)
    probe_engine_steps(DynamicInferenceEngine)
    _patches.wrap(rl_utils, "get_grpo_data_iterator", rollout, required=True)
    _patches.wrap(training, "train_step", train_step, required=True)
    _patches.wrap(training, "training_log", before=training_log, required=True)
    # the original ends with os._exit(0): write first
    _patches.wrap(rl_utils, "rl_inference_interface_shutdown",
                  before=lambda *args, **kwargs: write_record(prefix), required=True)
    atexit.register(write_record, prefix)  # a crash still leaves what was measured


def _count_tokens(grouped) -> tuple:
    """(generated tokens, evictions, rollouts) of Megatron-LM's rollouts (every rank
    holds all of them after the broadcast)."""
    tokens = evictions = count = 0
    for group in grouped or ():
        for rollout in group:
            count += 1
            evictions += sum(getattr(rollout, "num_evictions", None) or [])
            mask = getattr(rollout, "generation_mask", None)
            if mask is not None:
                tokens += sum(sum(bool(x) for x in turn) for turn in mask)
            elif getattr(rollout, "prompt_length", None) is not None:
                tokens += sum(len(t) for t in rollout.trajectory) - sum(rollout.prompt_length)
    return tokens, evictions, count


def mark(event: str) -> None:
    _record["events"].append((event, time.monotonic()))


def start_memory_trace(interval_s: float, read_free=None):
    """Rank 0 samples the GPU's free memory (the whole device: every rank's use);
    ``read_free()``: the free bytes (default: CUDA's, of this rank's device). Returns
    an event that stops the sampling."""
    import threading

    if read_free is None:
        import torch

        device = torch.cuda.current_device()
        _record.setdefault("gpu_total_bytes", torch.cuda.mem_get_info()[1])  # for "in use"

        def read_free():
            torch.cuda.set_device(device)  # the sampling thread's own current device
            return torch.cuda.mem_get_info()[0]

    stop = threading.Event()

    def sample():
        while not stop.is_set():
            _record["memory_trace"].append((time.monotonic(), read_free()))
            time.sleep(interval_s)

    threading.Thread(target=sample, name="memory-trace", daemon=True).start()
    return stop


def hold_standin_memory(leave_gib: float) -> None:
    """A fixed allocation standing for a larger model's weights and optimizer state,
    so the KV buffer without the package is what a real job would have left: each
    rank takes its share of the GPU (total / ranks on it) less ``leave_gib``."""
    import torch

    device = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(device)
    sharing = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")) // torch.cuda.device_count())
    total = torch.cuda.mem_get_info(device)[1]
    standin = int(total / sharing - leave_gib * 2**30)
    _held.append(torch.empty(max(0, standin), dtype=torch.uint8, device="cuda"))
    _record.update(standin_bytes=standin, leave_bytes=int(leave_gib * 2**30),
                   ranks_sharing_gpu=sharing, gpu_total_bytes=total)


_held: list = []


def _nccl_version() -> str:
    """The loaded library's version (a preloaded NCCL differs from torch's pin)."""
    from amem_callbacks.nccl_library import NcclLibrary

    library = NcclLibrary.loaded()
    return library.version_str if library is not None else "none"


def _nccl_total_bytes() -> int:
    """NCCL's own account of every communicator of this rank (active or not)."""
    from torch.distributed import distributed_c10d as c10d

    from amem_callbacks.backends.nccl import torch_comm_handle
    from amem_callbacks.nccl_library import STAT_TOTAL, NcclLibrary

    library, total = NcclLibrary.loaded(), 0
    for group in list(c10d._world.pg_map):
        handle, _why = torch_comm_handle(group)
        if handle is not None and handle.ptr and library is not None:
            total += library.comm_mem_stat(handle.ptr, STAT_TOTAL)
    return total


def _megatron_version() -> str:
    import megatron.core

    return megatron.core.__version__


def _number(value):
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item() if value.numel() == 1 else value.float().mean().item()
    if isinstance(value, (list, tuple)):
        return [_number(v) for v in value]
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _controller():
    module = sys.modules.get("amem_callbacks.adapters.megatron.hooks")
    return module.current_controller() if module is not None else None


def _amem_active() -> bool:
    controller = _controller()
    return bool(controller is not None and controller.active)


def amem_summary() -> dict:
    controller = _controller()
    if controller is None:
        return {"installed": False}
    transitions = []
    for via, report in controller.reports:
        transitions.append({
            "via": via, "kind": str(report.kind), "backend": report.backend,
            "skipped": report.skipped, "summary": report.summary(),
            "suspended": [g.name for g in report.suspended],
            "resumed": [g.name for g in report.groups if str(g.action) == "resumed"],
            "kept": {g.name: g.reason for g in report.kept},
            "nccl_bytes": report.nccl_bytes, "gpu_wide_freed_bytes": report.device_freed_bytes,
            "ranks_on_this_gpu": report.device_shared_by, "seconds": report.total_seconds,
            "wall_seconds": report.wall_seconds, "started": report.started,
            "held_seconds": report.held_seconds,
            "groups": [{"name": g.name, "size": g.size, "action": str(g.action),
                        "bytes": g.suspendable_bytes, "stays_bytes": g.stays_bytes,
                        "path": g.path, "transport": g.transport} for g in report.groups]})
    session = controller.session
    groups = controller.rollout_groups
    return {"installed": True, "rollout_groups": groups.describe() if groups else None,
            "transitions": transitions,
            "metrics": session.metrics() if session is not None else {},
            "caller_waits": dict(session.waited) if session is not None else {},
            "kv_cache": [dict(r.as_dict(), summary=r.summary()) for r in controller.kv_reports],
            "kv_growth": kv_growth_summary(controller),
            "settings": vars(controller.settings) if hasattr(controller.settings, "__dict__")
            else str(controller.settings)}


def kv_growth_summary(controller) -> dict:
    """Each rollout's growth decision and what this rank measured of it (the
    ``amem/kv_cache/decision`` and ``amem/kv_cache/measured/*`` metrics, which go to
    Megatron's writers only), through the controller's read-only ``growth``; None
    without ``--rl-amem-grow-kv-cache``."""
    growth = controller.growth
    if growth is None:
        return None
    return {"decisions": [dict(d.as_dict(), why=d.why) for d in growth.decisions],
            "measured": [f.as_dict() for f in growth.measured]}


def write_record(prefix: str) -> None:
    if _record.get("written"):
        return
    _record["written"] = True
    import torch
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    from tests.gpu.common import commit, machine

    for key, read in (("amem", amem_summary), ("torch", lambda: torch.__version__),
                      ("commit", commit), ("machine", machine),
                      ("nccl", _nccl_version), ("megatron_core", _megatron_version),
                      ("torch_max_reserved_bytes", torch.cuda.max_memory_reserved),
                      ("nccl_total_bytes", _nccl_total_bytes)):
        try:
            _record[key] = read()
        except Exception as exc:  # the record must still be written
            _record["errors"].append(f"{key}: {exc!r}")
    _record.update(
        rank=rank,
        standins=["flash_attn (pure PyTorch paged attention)",
                  "megatron_thd_spec (SDPA core attention for packed sequences)",
                  "wandb (annotation only)", "reward-only agent tests/gpu/megatron_rl_agent.py",
                  "127.0.0.1 for rank 0's servers"])
    with open(f"{prefix}.rank{rank}.json", "w") as f:
        json.dump(_record, f, indent=1, default=str)


# --- comparing the runs ---------------------------------------------------
def load_run(prefix: str) -> dict:
    ranks = {}
    folder = os.path.dirname(prefix) or "."
    for name in sorted(os.listdir(folder)):
        if name.startswith(os.path.basename(prefix) + ".rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
            ranks[data["rank"]] = data
    return ranks


def _losses(run: dict) -> list:
    last = max(run)  # Megatron reduces the loss dict to the last rank
    return [(it["iteration"], it["loss"]) for it in run[last]["iterations"]]


def _max_abs_diff(losses: list, reference: list) -> dict:
    """Per loss key, the largest difference at the same iteration."""
    out = {}
    for (_, mine), (_, theirs) in zip(losses, reference):
        for key in set(mine) & set(theirs):
            if isinstance(mine[key], float) and isinstance(theirs[key], float):
                out[key] = max(out.get(key, 0.0), abs(mine[key] - theirs[key]))
    return out


def _step_seconds(run: dict) -> float:
    times = [it["time"] for it in run[0]["iterations"]]
    steps = [b - a for a, b in zip(times, times[1:])]  # iteration 2..N, rollout included
    return statistics.median(steps) if steps else float("nan")


def _free_at_kv(run: dict, rank: int) -> dict:
    """Each rollout's KV-cache allocation at the engine's resume, by iteration: the
    first of its iteration after the launch's (the launch comes before any rollout
    began). With ``--rl-amem-grow-kv-cache`` a rollout may hold a second one, the
    regrow mid-rollout; it comes after the engine's own suspend gave the first cache
    back, so its free bytes count that cache too and compare with nothing in a run
    without growth."""
    out = {}
    for allocation in run[rank]["kv_cache_allocations"][1:]:
        out.setdefault(allocation["iteration"], allocation)
    return out


def _free_gain(runs: dict, gpu_bytes: int, summary: dict) -> dict:
    """The free memory each allocation of the amem run found over the baseline's.
    Nothing waits for the suspends at the engine's resume, so the gain is held against
    what the GPU's ranks had freed by then (their records say, from the package's
    own account); records without that account are held against every suspended
    byte, as the first design waited for them. Returns the check (name -> verdict),
    empty when nothing had been freed by any allocation (then not judged)."""
    rows, gains, freed_then = {}, [], {}
    for rank in sorted(runs["amem"]):
        base = _free_at_kv(runs["baseline"], rank)
        for iteration, allocation in _free_at_kv(runs["amem"], rank).items():
            theirs = base.get(iteration, {}).get("free_bytes")
            gain = None if theirs is None else allocation["free_bytes"] - theirs
            rows.setdefault(rank, {})[iteration] = {
                "baseline": theirs, "amem": allocation["free_bytes"], "gain": gain,
                "amem_freed_bytes": allocation.get("amem_freed_bytes"),
                "amem_suspends_done": allocation.get("amem_suspends_done")}
            if gain is not None:
                gains.append((iteration, gain))
            if allocation.get("amem_freed_bytes") is not None:  # ranks share the GPU
                freed_then[iteration] = freed_then.get(iteration, 0) + allocation[
                    "amem_freed_bytes"]
    summary["free_at_kv_cache"] = rows
    summary["median_free_gain_bytes"] = statistics.median(g for _, g in gains) if gains else None
    if not freed_then:
        return {"free memory at KV-cache allocation rose by >= 90% of the GPU's suspended "
                "bytes": bool(gains) and gpu_bytes > 0 and statistics.median(
                    g for _, g in gains) >= 0.9 * gpu_bytes}
    summary["gpu_freed_bytes_at_kv_cache"] = freed_then
    judged = [(gain, freed_then[it]) for it, gain in gains if freed_then.get(it, 0) > 0]
    if not judged:
        summary["free_gain_not_judged"] = ("the suspends had freed nothing yet at any "
                                           "allocation (nothing waits for them)")
        return {}
    summary["free_gain_over_freed"] = [gain / freed for gain, freed in judged]
    return {"free memory at KV-cache allocation rose by >= 90% of what the GPU's ranks had "
            "freed by then": statistics.median(summary["free_gain_over_freed"]) >= 0.9}


def merge(baseline: str, amem: str, control: str, out: str) -> dict:
    runs = {"baseline": load_run(baseline), "amem": load_run(amem)}
    if control:  # '' when no control run was made
        runs["control"] = load_run(control)
    summary = {"runs": {k: sorted(v) for k, v in runs.items()}, "checks": {}}
    checks = summary["checks"]
    world = len(runs["baseline"])
    checks["every rank of every run wrote its record (no hang, no crash)"] = all(
        len(r) == world and all(not d["errors"] for d in r.values()) for r in runs.values())
    begins = [t for t in runs["amem"][0]["amem"].get("transitions", []) if t["kind"] == "begin"]
    summary["amem_begins_rank0"] = begins
    suspended_bytes = {rank: [t["nccl_bytes"] for t in data["amem"].get("transitions", [])
                              if t["kind"] == "begin"]
                       for rank, data in runs["amem"].items()}
    summary["suspended_nccl_bytes_per_begin"] = suspended_bytes
    checks["groups were suspended at every rollout"] = bool(begins) and all(
        t["suspended"] for t in begins) and len(begins) == len(runs["amem"][0]["rollouts"])
    gpu_bytes = sum(b[-1] for b in suspended_bytes.values() if b)  # ranks share the GPU
    summary["gpu_suspended_nccl_bytes"] = gpu_bytes
    checks.update(_free_gain(runs, gpu_bytes, summary))
    totals = {rank: {k: v for k, v in data["amem"].get("metrics", {}).items()
                     if k.startswith("amem/total/")}
              for rank, data in runs["amem"].items()}
    summary["amem_totals"] = totals
    checks["no collective reached a suspended group (guard resumes 0)"] = all(
        t.get("amem/total/auto_resumes") == 0 for t in totals.values())
    base_losses = _losses(runs["baseline"])
    summary["losses"] = {name: _losses(run) for name, run in runs.items()}
    identical = _losses(runs["amem"]) == base_losses
    if control and _losses(runs["control"]) != base_losses:
        # The loop itself is not deterministic run to run (two engines take the
        # coordinator's requests in arrival order and sample): two samples give
        # no tolerance worth a verdict, so the spreads are reported side by side.
        summary["losses_not_judged"] = ("the control run (baseline again) differs from the "
                                        "baseline: the loop is not deterministic run to run")
        summary["loss_max_abs_diff_vs_baseline"] = {
            name: _max_abs_diff(_losses(runs[name]), base_losses) for name in ("amem", "control")}
    else:
        checks["losses identical to the baseline"] = identical
    summary["step_seconds_median"] = {name: _step_seconds(run) for name, run in runs.items()}
    summary["step_time_ratio_amem_over_baseline"] = (
        summary["step_seconds_median"]["amem"] / summary["step_seconds_median"]["baseline"])
    summary["rollout_seconds"] = {name: [r["seconds"] for r in run[0]["rollouts"]]
                                  for name, run in runs.items()}
    summary["versions"] = {k: runs["amem"][0].get(k) for k in ("torch", "nccl", "megatron_core")}
    summary["standins"] = runs["amem"][0].get("standins")
    summary["ok"] = all(checks.values())
    from tests.gpu.common import provenance

    summary.update(provenance("tests/gpu/megatron_rl_gpu.py"))
    with open(out, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary


def wrapper_parser() -> argparse.ArgumentParser:
    """This file's own flags; every other one goes to train_rl.py."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe-out", help="prefix of the per-rank JSON records")
    parser.add_argument("--mlm", help="Megatron-LM tree with train_rl.py and megatron/rl")
    parser.add_argument("--work", default="/tmp/amem_megatron_rl", help="tokenizer and config")
    parser.add_argument("--merge", nargs=3, metavar=("BASELINE", "AMEM", "CONTROL"),
                        help="compare three runs' prefixes (CONTROL may be '')")
    parser.add_argument("--summary", help="with --merge: where to write the comparison")
    parser.add_argument("--amem-leave-gb", type=float, default=0.0,
                        help="hold all of this rank's share of the GPU but this many GiB, "
                             "standing for a larger model's weights and optimizer state")
    parser.add_argument("--amem-vocab", type=int, default=0,
                        help="pad the test tokenizer to this many tokens (rare end token: "
                             "generations run to --inference-max-seq-length)")
    parser.add_argument("--amem-memory-trace", type=float, default=0.0, metavar="SECONDS",
                        help="rank 0 samples the GPU's free memory at this interval")
    parser.add_argument("--amem-stop-after-rollouts", type=int, default=0, metavar="N",
                        help="write the record and exit once N rollouts are back (runs that "
                             "measure the rollouts only: no training after them)")
    return parser


def main(argv=None) -> None:
    parser = wrapper_parser()
    ours, rest = parser.parse_known_args(argv)
    if ours.merge:
        summary = merge(*ours.merge, ours.summary)
        print(json.dumps({k: summary[k] for k in ("checks", "ok", "step_seconds_median")},
                         indent=1))
        return
    if not (ours.probe_out and ours.mlm):
        parser.error("give --probe-out PREFIX and --mlm DIR (or --merge)")
    _record["command"] = {"wrapper_argv": list(sys.argv),
                          "amem_launcher": "amem_callbacks.adapters.megatron.hooks" in sys.modules}
    share_the_gpu()
    add_sources(os.path.abspath(ours.mlm))
    rank = os.environ.get("RANK", "0")
    os.makedirs(ours.work, exist_ok=True)
    tokenizer = make_tokenizer(os.path.join(ours.work, f"tokenizer-rank{rank}-v{ours.amem_vocab}"),
                               ours.amem_vocab)
    if ours.amem_leave_gb:
        hold_standin_memory(ours.amem_leave_gb)
    if ours.amem_memory_trace and rank == "0":
        start_memory_trace(ours.amem_memory_trace)
    env_config = write_env_config(os.path.join(ours.work, f"env-rank{rank}.yaml"))
    # Megatron's training module first: it imports megatron.rl inside a try and
    # reads a failure as "no RL package"; importing megatron.rl first makes
    # that import circular (measured: "RL cannot run without the megatron.rl package").
    from megatron.training import training

    if not training.has_rl_utils:
        import megatron.rl.rl_utils  # noqa: F401  (raises the error Megatron swallowed)

    keep_servers_local()
    register_agent()
    install_probes(os.path.abspath(ours.probe_out), ours.amem_stop_after_rollouts)
    script = os.path.join(os.path.abspath(ours.mlm), "train_rl.py")
    sys.argv = [script, *TINY, "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", tokenizer, "--langrl-env-config", env_config, *rest]
    _record["command"]["train_rl_argv"] = list(sys.argv)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
