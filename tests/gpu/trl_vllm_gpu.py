"""Issue 34: TRL GRPO with a colocated vLLM 0.31 (sleep mode), with and without
AMemCallback. Does the NCCL memory the package frees become vLLM's KV cache?

vLLM sizes its KV cache once, at start-up, from ``vllm_gpu_memory_utilization``;
sleep and wake-up keep that size. The package cannot grow it: it tells the user
how far the share may rise (the headroom line, ``amem/headroom/gpu_memory_utilization``).
This measures what that buys: at the default share and at the raised one, with
and without the package, vLLM's own KV cache size, generation tokens/s, step time
and losses, and whether the raised share fails without the package (vLLM's KV
wake-up, or its start-up, out of memory: the line is kept).

Two roles (the bundle first: tests/gpu/bundle_vllm.sh, tests/gpu/vllm_bundle.py):

``run`` (one training run, under torchrun; each rank its own vLLM engine, as
TRL's colocate mode does; several ranks on one GPU need NCCL_MULTI_RANK_GPU_ENABLE=1,
which the bundle's environment sets)::

    eval "$(python3 tests/gpu/vllm_bundle.py env)"
    python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/trl_vllm_gpu.py run \\
        /tmp/r/amem --share 0.3 --amem          # or --no-amem; -> /tmp/r/amem.rankN.json

``pairs`` (the orchestrator, plain python3; resumable: run the same line again in
the next device call and it goes on where the last one stopped)::

    python3 tests/gpu/trl_vllm_gpu.py pairs --state /tmp/trl-vllm --out $OUT \\
        --git-head <sha> --budget-s 540

It starts with a probe (no package, TRL's default share 0.3) that measures the
GPU's free memory while vLLM generates and while the model trains, and from it
sets the default share and a ballast (memory each trainer holds, standing in
for a larger training state) so that vLLM's cache is ``--kv-target-gib`` and the
GPU has ``--slack-gib`` left while generating (``edge_plan``): a share at the edge
of what fits without the package, as a user tunes it. Then interleaved pairs
(ABBA) at that share, then pairs at the raised shares: the package's headroom
line, followed step by step as a user would (the package's run at a raised share
that still fitted without it recommends the next one, ``HEADROOM_STEPS``), and the
per-rank figure (``raised_shares``: on a GPU that several ranks
share, the headroom line counts every rank's freed memory for each rank's
engine). The summary (``summary.json``; key ``raised_share_fails_without``) goes
to ``--out`` after every run.

Ranks sharing a GPU: vLLM's start-up measures the GPU's free memory and assumes
nobody else changes it meanwhile, and its sleep asserts that the free memory
rose; so the ranks take their start-up measurements in turn (``take_turns``) and
meet, through the c10d store or a gloo group (never an NCCL collective the
experiment did not have), before each sleep and KV wake-up.

CPU mode (``AMEM_GPU_DRIVER_ON_CPU=1``, tests/gpu/common.py; what
tests/test_trl_vllm_driver.py runs): gloo, the fake NCCL behind the callback and
a stand-in for ``vllm.LLM`` (it logs vLLM's KV-cache lines in vLLM's format) under
trl's real VLLMGeneration, so the order of trl's calls and the callback's begin and
end, the spies, the log parsing and the JSON are this file's own code; device
memory and time are not judged there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import types
from typing import Optional

#: when this rank's process began (before torch, vLLM and the model): a whole-run
#: figure counts from here, the start-up and the first generation's warm-up included
PROCESS_STARTED = time.monotonic()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.gpu.short_wake import parse_short_wake  # noqa: E402 - after the path is set
from amem_callbacks.tools.pairs import one_commit  # noqa: E402
from experiments.largest_setting import Search  # noqa: E402

GIB = 2**30
#: the share TRL's GRPOConfig defaults to (vllm_gpu_memory_utilization)
TRL_DEFAULT_SHARE = 0.3
SYNC_ROLE = "trl_vllm_sync"  # the spies' gloo barriers run on it while generating
DRIVER = "tests/gpu/trl_vllm_gpu.py"  # as common.provenance names it
CODE_FILES = ("tests/gpu/trl_vllm_gpu.py", "tests/gpu/short_wake.py", "tests/gpu/vllm_bundle.py",
              "adapters/trl.py", "adapters/_trl_groups.py", "amem_callbacks/headroom.py")

# --- vLLM's own log lines ------------------------------------------------------------
# vLLM 0.31.0's format strings (0.34.0's too):
# vllm/v1/worker/gpu_worker.py (KV memory, sleep,
# start-up check), vllm/v1/core/kv_cache_utils.py (cache size),
# vllm/v1/executor/abstract.py (wake-up), vllm/cumem_allocator (its CUDA error text),
# torch's allocator. The numbers are vLLM's rounding (GiB to 2 decimals).
KV_MEMORY = re.compile(r"Available KV cache memory: (-?[0-9.]+) GiB")
KV_TOKENS = re.compile(r"KV cache size: ([0-9,]+) tokens, Maximum concurrency for "
                       r"([0-9,]+) tokens per request: ([0-9.]+)x")
SLEEP = re.compile(r"Sleep mode freed ([0-9.]+) GiB memory, ([0-9.]+) GiB memory is still in use")
WAKE = re.compile(r"It took ([0-9.]+) seconds to wake up tags (.*)\.")
#: (kind, pattern): the first that matches names how a run ran out of memory
FAILURES = (
    ("start-up: free memory below the share",
     re.compile(r"Free memory on device .* on startup is less than desired GPU memory "
                r"utilization")),
    ("start-up: no memory for the KV cache",
     re.compile(r"No available memory for the cache blocks|larger than the available KV "
                r"cache memory|KV cache is needed, which is larger than")),
    ("cuMem out of memory (sleep-mode wake-up)", re.compile(r"CUDA Error: out of memory at")),
    ("torch out of memory", re.compile(r"CUDA out of memory|OutOfMemoryError")),
)


def parse_vllm_lines(lines) -> dict:
    """What vLLM's own INFO lines say: KV cache bytes (vLLM's 2-decimal GiB), tokens and
    concurrency, every sleep's freed / still-used GiB and every wake-up's seconds."""
    out = {"kv_cache_bytes": None, "kv_cache_tokens": None, "max_model_len": None,
           "max_concurrency": None, "sleeps": [], "wakes": []}
    for line in lines:
        if (m := KV_MEMORY.search(line)) and out["kv_cache_bytes"] is None:
            out["kv_cache_bytes"] = int(float(m.group(1)) * GIB)
        elif (m := KV_TOKENS.search(line)) and out["kv_cache_tokens"] is None:
            out["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
            out["max_model_len"] = int(m.group(2).replace(",", ""))
            out["max_concurrency"] = float(m.group(3))
        elif m := SLEEP.search(line):
            out["sleeps"].append({"freed_gib": float(m.group(1)), "in_use_gib": float(m.group(2))})
        elif m := WAKE.search(line):
            out["wakes"].append({"seconds": float(m.group(1)), "tags": m.group(2)})
    return out


def failure_line(lines) -> Optional[dict]:
    """The first out-of-memory line of a run: {kind, line}; None when there is none."""
    for line in lines:
        for kind, pattern in FAILURES:
            if pattern.search(line):
                return {"kind": kind, "line": line.strip()[:600]}
    return None


class VllmLog(logging.Handler):
    """vLLM's log records of this process (its loggers are children of "vllm"),
    kept as text: each rank reads its own engine's lines, not the interleaved stdout.

    On GPU the run turns vLLM's own logging set-up off (VLLM_CONFIGURE_LOGGING=0):
    vLLM 0.31 applies its dictConfig while the engine is built, which would drop it."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.lines: list = []

    def emit(self, record):
        try:
            self.lines.append(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that cannot format is not ours to fix
            pass

    def install(self, echo: bool = False) -> "VllmLog":
        """``echo``: also print the records to stdout, as vLLM's own set-up would."""
        vllm_logger = logging.getLogger("vllm")
        if vllm_logger.getEffectiveLevel() > logging.INFO:  # unconfigured: ours to set
            vllm_logger.setLevel(logging.INFO)
        vllm_logger.addHandler(self)
        if echo:
            stream = logging.StreamHandler(sys.stdout)
            stream.setFormatter(logging.Formatter(
                f"(rank {os.environ.get('RANK', '0')}) %(levelname)s %(asctime)s "
                "[%(filename)s:%(lineno)d] %(message)s"))
            vllm_logger.addHandler(stream)
            vllm_logger.propagate = False  # once, not again through the root's handlers
        return self


# --- the model, built in code ----------------------------------------------------------
VOCAB = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(4093)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def build_model(args, folder: str):
    """A random Qwen2 (seed 0), saved to ``folder`` in bf16 with its tokenizer (vLLM
    loads it from there: trl hands vLLM ``model.name_or_path``), and loaded back in
    fp32 for training, so that its name_or_path is ``folder``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=args.hidden,
                         num_hidden_layers=args.layers, intermediate_size=args.hidden * 11 // 4,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.max_model_len, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None, tie_word_embeddings=True)
    os.makedirs(folder, exist_ok=True)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                            attn_implementation="sdpa")


def dataset(words: int):
    from datasets import Dataset

    n = len(VOCAB) - 3
    return Dataset.from_dict({"prompt": [" ".join(f"w{(i * 131 + j * 17) % n}" for j in range(words))
                                         for i in range(1024)]})


def reward(completions, **kwargs):
    return [len(set(c.split())) / (1 + len(c.split())) for c in completions]


def kv_bytes_per_token(args) -> int:
    """K and V of every layer, bf16: what one cached token costs vLLM."""
    return 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 2


# --- a stand-in for vllm.LLM (CPU mode only) --------------------------------------------
class _Logprob:
    def __init__(self, value):
        self.logprob, self.rank = value, 1


class StandInLLM:
    """What trl 1.16's VLLMGeneration calls on ``vllm.LLM`` in colocate mode, on CPU:
    sleep/wake_up by tag, generate, reset_prefix_cache, and the model whose
    ``load_weights`` trl's weight sync calls. It logs vLLM's KV-cache lines in vLLM
    0.31's format from a cache sized like vLLM's (share x total - non-KV memory), so
    the parsing below runs on this driver's real path, and refuses a share above the
    free memory at start-up with vLLM's message, so the failure path does too."""

    TOTAL = 80 * GIB  # the CPU mode's stand-in device (tests/gpu/common.STAND_IN_MEMORY)
    NON_KV = 2 * GIB
    BYTES_PER_TOKEN = 4096

    def __init__(self, model, gpu_memory_utilization, max_model_len=None, enable_sleep_mode=False,
                 **kwargs):
        self.kwargs = dict(kwargs, model=model, enable_sleep_mode=enable_sleep_mode)
        self.max_model_len = max_model_len or 2048
        self.sleeping: set = set()
        self.loaded = 0
        log = logging.getLogger("vllm.stand_in")
        free = self.memory_snapshot()
        requested = int(gpu_memory_utilization * self.TOTAL)
        if free < requested:
            raise ValueError(f"Free memory on device cpu ({round(free / GIB, 2)}/"
                             f"{round(self.TOTAL / GIB, 2)} GiB) on startup is less than desired "
                             f"GPU memory utilization ({gpu_memory_utilization}, "
                             f"{round(requested / GIB, 2)} GiB). Decrease GPU memory utilization "
                             "or reduce GPU memory used by other processes.")
        kv = self.determine_available_memory(requested)
        tokens = kv // self.BYTES_PER_TOKEN
        log.info("Available KV cache memory: %s GiB", f"{round(kv / GIB, 2)}")
        log.info("%s KV cache size: %s tokens, Maximum concurrency for %s tokens per request: "
                 "%.2fx", "GPU", f"{tokens:,}", f"{self.max_model_len:,}",
                 tokens / self.max_model_len)
        owner = self

        class _Model:
            def load_weights(self, weights):
                owner.loaded += len(list(weights))

        runner = types.SimpleNamespace(model=_Model())
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(model_runner=runner)))

    def memory_snapshot(self) -> int:
        """Where vLLM takes its start-up snapshot of the free memory (gpu_worker's
        MemorySnapshot): take_turns waits here."""
        import torch

        return torch.cuda.mem_get_info()[0]  # the CPU mode's stand-in device

    def determine_available_memory(self, requested: int) -> int:
        """Where vLLM's profiling ends (before its external launcher's MIN over
        ranks): take_turns signals the next rank here."""
        return requested - self.NON_KV

    def sleep(self, level=1):
        self.sleeping = {"weights", "kv_cache"}
        logging.getLogger("vllm.stand_in").info(
            "Sleep mode freed %s GiB memory, %s GiB memory is still in use.", "1.5", "3.0")

    def wake_up(self, tags=None):
        woken = set(tags) if tags else set(self.sleeping)
        self.sleeping -= woken
        logging.getLogger("vllm.stand_in").info("It took %.6f seconds to wake up tags %s.",
                                                0.001, sorted(woken))

    def reset_prefix_cache(self):
        return True

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        if self.sleeping:
            raise RuntimeError(f"generate while {sorted(self.sleeping)} sleep")
        length = (sampling_params or {}).get("max_tokens", 4)
        outputs = []
        for i, p in enumerate(prompts):
            ids = [3 + (sum(p["prompt_token_ids"]) + i * 5 + j * 3) % (len(VOCAB) - 3)
                   for j in range(length)]
            out = types.SimpleNamespace(token_ids=ids, logprobs=[{t: _Logprob(-1.0)} for t in ids])
            outputs.append(types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                                 outputs=[out]))
        return outputs


def note_vllm_start(out: dict, memory_now, store=None, world: int = 1) -> None:
    """Record, when trl builds ``vllm.LLM``, the GPU's free memory and whether the
    default group's NCCL communicator exists yet: vLLM checks its share against the
    free memory then, and torch creates communicators at a group's first collective
    (accelerate passes no device_id), so memory that communicator takes later is not
    in that check but is in the way of every KV wake-up. Asked of torch itself (the
    CPU mode's fake NCCL would make one on being asked).

    ``store`` (ranks sharing a GPU): the engine trl puts to sleep right after building
    it sleeps only once every rank's engine is built, through the c10d store (a
    collective there would create the default group's communicator): vLLM asserts
    that the GPU's free memory rose across a sleep, and a rank still capturing CUDA
    graphs beside it could make it fall."""
    import torch.distributed as dist
    import trl.generation.vllm_generation as module

    from amem_callbacks.backends.nccl import torch_comm_handle

    real = module.LLM

    def build(*args, **kwargs):
        handle, why = torch_comm_handle(dist.group.WORLD)
        out["at_vllm_start"] = {"free_bytes": memory_now(), "world_communicator": bool(handle),
                                "why_not": None if handle else why}
        try:
            llm = real(*args, **kwargs)
        except BaseException:
            if store is not None:  # failed before its profiling ended: let the next rank try
                signal_profiled(store, dist.get_rank())
            raise
        if store is not None:
            sleep = llm.sleep

            def first_sleep(*a, **k):
                llm.sleep = sleep  # once: later sleeps are the spies' to sync
                store_barrier(store, "first-sleep", dist.get_rank(), world)
                out["at_vllm_start"]["first_sleep_synced"] = True
                return sleep(*a, **k)

            llm.sleep = first_sleep
        return llm

    module.LLM = build


STORE_PREFIX = "amem-trl-vllm/"


def store_barrier(store, name: str, rank: int, world: int, timeout_s: float = 900) -> None:
    """Every rank reached ``name``, through the c10d store (no NCCL)."""
    from datetime import timedelta

    store.set(f"{STORE_PREFIX}{name}/{rank}", "1")
    store.wait([f"{STORE_PREFIX}{name}/{r}" for r in range(world)], timedelta(seconds=timeout_s))


def signal_profiled(store, rank: int) -> None:
    store.set(f"{STORE_PREFIX}profiled/{rank}", "1")


def take_turns(store, rank: int, record: dict, snapshot=None, profile=None,
               timeout_s: float = 900) -> None:
    """Ranks sharing a GPU measure vLLM's start-up memory one after the other.

    vLLM's worker snapshots the free memory after its distributed set-up and sizes
    the KV cache from what its profiling run adds to it, assuming nobody else on
    the GPU allocates or frees meanwhile (it asserts the free memory did not grow:
    vLLM ``v1/worker/gpu_worker.py:727``); on a GPU several ranks share, a
    neighbour's weights or released profiling buffers land in that window. So rank
    r takes its snapshot once rank r-1's profiling is over (rank r-1 then waits in
    the external launcher's MIN over ranks, where rank r joins it): no collective
    is waited for out of order. ``snapshot`` and ``profile`` are (owner, name) of
    the two steps: vLLM's ``MemorySnapshot`` in gpu_worker and ``Executor.
    determine_available_memory`` (what the external launcher's override calls
    first), or the CPU stand-in's."""
    import time as clock
    from datetime import timedelta

    if snapshot is None:
        import vllm.v1.worker.gpu_worker as gpu_worker
        from vllm.v1.executor.abstract import Executor

        snapshot, profile = (gpu_worker, "MemorySnapshot"), (Executor, "determine_available_memory")
    owner, name = snapshot
    take = getattr(owner, name)
    waited = []

    def taken(*args, **kwargs):
        if not waited and rank > 0:  # the start-up snapshot: the first one taken
            store.wait([f"{STORE_PREFIX}profiled/{rank - 1}"], timedelta(seconds=timeout_s))
        waited.append(True)
        record.setdefault("snapshot_at", clock.time())
        return take(*args, **kwargs)

    setattr(owner, name, taken)
    owner, name = profile
    measure = getattr(owner, name)

    def measured(*args, **kwargs):
        try:
            return measure(*args, **kwargs)
        finally:  # also after a failure: the next rank must not wait for ever
            record.setdefault("profiled_at", clock.time())
            signal_profiled(store, rank)

    setattr(owner, name, measured)


def import_callback():
    """AMemCallback from the installed package (a bare tree stops with the install
    command: common.require_installed_package)."""
    from tests.gpu.common import require_installed_package

    require_installed_package()
    from amem_callbacks.adapters.trl import AMemCallback

    return AMemCallback


def use_stand_in_vllm() -> None:
    """CPU mode: trl's VLLMGeneration builds StandInLLM where it would build vllm.LLM
    (trl imports vLLM's names only when vLLM is installed)."""
    import trl.generation.vllm_generation as module

    module.is_vllm_available = lambda *args, **kwargs: True
    module.LLM = StandInLLM
    module.SamplingParams = lambda **kwargs: kwargs


# --- what one rank records --------------------------------------------------------------
class Recorder:
    """The spies' shared state: the ordered events, the stage a failure happened in,
    each generation's figures and the free-memory minimum of each phase."""

    def __init__(self, device_memory):
        self.events: list = []
        self.stage = "set-up"
        self.generations: list = []
        self.pending: dict = {}  # the weight sync's figures, until its generation starts
        self.phase = "train"
        self.phase_min: dict = {}  # (phase, generation index) -> min free bytes seen
        # () -> free bytes (GPU-wide) without a synchronize: cudaMemGetInfo counts
        # allocations when they are made, and the sampler must not wait for the GPU
        self._memory = device_memory
        self._stop = threading.Event()
        self._thread = None
        self.reports = {"begin": [], "end": []}

    def note(self, what: str, **extra) -> None:
        self.events.append(dict(what=what, t=time.monotonic(), **extra))

    def current(self) -> dict:
        return self.generations[-1] if self.generations else self.pending

    def generation_starts(self, step: int) -> dict:
        """A new generation's record (at vLLM's KV wake-up), with the weight sync's
        figures that came before it."""
        self.generations.append(dict(self.pending, step=step))
        self.pending = {}
        return self.generations[-1]

    def observe(self, free: Optional[int]) -> None:
        """A reading taken by a spy: counts for the phase it was taken in (a phase
        may be shorter than the sampler's period)."""
        if free is not None:
            key = (self.phase, len(self.generations))
            self.phase_min[key] = min(free, self.phase_min.get(key, free))

    def start_sampler(self, every_s: float = 0.02) -> None:
        """Free device memory every ``every_s`` for the whole training: the minimum of
        each generation and of the training between generations."""
        def loop():
            while not self._stop.wait(every_s):
                self.observe(self._memory())

        self._thread = threading.Thread(target=loop, name="trl-vllm-memory", daemon=True)
        self._thread.start()

    def stop_sampler(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def minima(self) -> list:
        """Per generation index: the lowest free memory while generating, and while
        training right after it."""
        out = []
        for index in range(1, len(self.generations) + 1):
            out.append({"generation": index,
                        "min_free_generating": self.phase_min.get(("generation", index)),
                        "min_free_training_after": self.phase_min.get(("train", index))})
        return out


def torch_reserved(start_peak_window: bool = False) -> int:
    """This process's bytes in torch's caching allocator. vLLM's KV cache and weights
    sit in segments torch counts as reserved through sleep and wake-up alike, so what
    reserved rises by during generate is the generation's own transient need
    (activations, sampler buffers), read exactly at its peak, which the 20 ms free-memory
    readings can miss. ``start_peak_window`` resets torch's peak counter (this driver's
    own process; the package never does)."""
    import torch

    if start_peak_window:
        torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_stats().get("reserved_bytes.all.current", 0)


def torch_reserved_peak() -> int:
    import torch

    return torch.cuda.memory_stats().get("reserved_bytes.all.peak", 0)


def spy(trainer, rec: Recorder, barrier, synced_sleep: bool, memory_now,
        short_wake=None) -> None:
    """Wrap vLLM's wake_up, generate and sleep and trl's weight sync on this trainer
    with plain functions: AMemCallback wraps wake_up and generate again at the first
    generation (it skips a wrapper of its own kind only), so its begin runs before
    these and the figures read here are taken after its suspends.

    ``barrier()`` (over a gloo group): at the KV wake-up, so the GPU-wide free memory
    is read with every rank at the same point, and (``synced_sleep``, ranks sharing a
    GPU) before sleep, which asserts that the GPU's free memory rose: another rank's
    wake-up at that moment would trip it. A KV wake-up the package calls again after
    it ran out of memory (only the short ranks do) is the same generation's: no new
    record, no barrier. ``short_wake`` (tests/gpu/short_wake.ShortWake) takes memory
    before the first attempt of the wake-up it is set for."""
    vg = trainer.vllm_generation
    llm = vg.llm
    wake_up, generate, sleep, sync_weights = llm.wake_up, llm.generate, llm.sleep, vg.sync_weights

    def timed(fn, *args, **kwargs):
        began = time.monotonic()
        result = fn(*args, **kwargs)
        return result, time.monotonic() - began

    def spied_sync_weights(*args, **kwargs):
        rec.note("sync_weights")
        rec.stage = "weight sync (vLLM weights wake-up, load_weights)"
        _, seconds = timed(sync_weights, *args, **kwargs)
        rec.pending["sync_weights_s"] = seconds

    kv_wake_failed = []  # this generation's KV wake-up ran out of memory: a retry comes

    def spied_wake_up(*args, **kwargs):
        tags = kwargs.get("tags", args[0] if args else None)
        kv = tags is None or "kv_cache" in tags
        retry = kv and bool(kv_wake_failed)
        rec.note("wake_up retry" if retry else "wake_up", tags=list(tags) if tags else None)
        if retry:
            gen = rec.current()
        elif kv:
            gen = rec.generation_starts(trainer.state.global_step)
            if short_wake is not None:
                taken = short_wake.before_wake(len(rec.generations), tags, memory_now())
                if taken is not None:
                    gen["short_wake"] = taken
            barrier()
            gen["free_before_kv_wake"] = memory_now()
            rec.stage = "vLLM KV-cache wake-up"
        else:
            gen = rec.pending
            rec.stage = "vLLM weights wake-up"
        try:
            result, seconds = timed(wake_up, *args, **kwargs)
        except Exception as error:
            if kv:
                kv_wake_failed.append(True)
                gen.setdefault("kv_wake_failures", []).append(f"{type(error).__name__}: "
                                                              f"{error}"[:300])
            raise
        kv_wake_failed.clear()
        if short_wake is not None and kv and short_wake.after_wake():
            gen["short_wake"]["released_after_attempts"] = 1 + len(gen.get("kv_wake_failures", []))
        gen[("wake_kv_retry_s" if retry else "wake_kv_s") if kv else "wake_weights_s"] = seconds
        if kv:
            rec.phase = "generation"
            gen["free_after_kv_wake"] = memory_now()
            gen["torch_reserved_at_kv_wake"] = torch_reserved(start_peak_window=True)
            rec.observe(gen["free_after_kv_wake"])
        return result

    def spied_generate(*args, **kwargs):
        rec.note("generate")
        rec.stage = "vLLM generate"
        outputs, seconds = timed(generate, *args, **kwargs)
        tokens = sum(len(o.token_ids) for out in outputs for o in out.outputs)
        gen = rec.current()
        gen.update(generate_s=seconds, tokens=tokens, sequences=len(outputs),
                   tokens_per_s=tokens / seconds if seconds > 0 else None,
                   free_after_generate=memory_now())
        if "torch_reserved_at_kv_wake" in gen:
            gen["torch_peak_beyond_kv_wake"] = (torch_reserved_peak()
                                                - gen["torch_reserved_at_kv_wake"])
        rec.observe(gen["free_after_generate"])
        return outputs

    def spied_sleep(*args, **kwargs):
        level = kwargs.get("level", args[0] if args else 1)
        rec.note("sleep", level=level)
        rec.phase = "train"
        if synced_sleep:
            barrier()
        rec.stage = "vLLM sleep"
        result, seconds = timed(sleep, *args, **kwargs)
        rec.current()["sleep_s"] = seconds
        rec.stage = "train"
        return result

    llm.wake_up, llm.generate, llm.sleep = spied_wake_up, spied_generate, spied_sleep
    vg.sync_weights = spied_sync_weights


def forced_short_wake(args, rank: int, ranks_on_gpu: int, device: int, callback, out: dict):
    """``--short-wake G:R``: the ShortWake that takes memory at that KV wake-up (on a
    GPU a real allocation; in the CPU mode, where the package never skips a begin,
    a ledger in the rank JSON)."""
    if args.short_wake is None:
        return None
    from amem_callbacks.adapters._vllm_memory import wake_bytes
    from tests.gpu.common import ON_CPU
    from tests.gpu.short_wake import ShortWake, device_taker, stand_in_taker

    def begin_skipped() -> bool:  # this generation's begin did not run
        session = getattr(callback, "session", None)
        return session is not None and not session.active

    take = stand_in_taker(out.setdefault("short_wake_ledger", [])) if ON_CPU else \
        device_taker(f"cuda:{device}")
    return ShortWake(args.short_wake, rank, ranks_on_gpu, take, begin_skipped, wake_bytes)


def record_transitions(rec: Recorder) -> None:
    """Every begin and end of the package's policies, as events and reports (class-wide:
    the callback builds its policy at the first generation)."""
    from amem_callbacks import OffloadPolicy

    for kind in ("begin", "end"):
        original = getattr(OffloadPolicy, kind)

        def recorded(self, *args, _original=original, _kind=kind, **kwargs):
            rec.note(_kind)
            report = _original(self, *args, **kwargs)
            rec.reports[_kind].append(report)
            return report

        setattr(OffloadPolicy, kind, recorded)


def step_figures(seconds: list, steps_per_generation: int) -> dict:
    """The mean over every step (``whole_run_mean_step_s``: what a user's job takes a
    step, the first generation's warm-up included), then the steady state: medians of
    the steps that generate (every ``steps_per_generation``-th from the first) and of
    the others, and the mean step, the first generation cycle left out."""
    later = list(enumerate(seconds))[steps_per_generation:]
    gen = [s for i, s in later if i % steps_per_generation == 0]
    train = [s for i, s in later if i % steps_per_generation]
    return {"whole_run_mean_step_s": statistics.mean(seconds) if seconds else None,
            "generation_step_s": statistics.median(gen) if gen else None,
            "train_step_s": statistics.median(train) if train else None,
            "mean_step_s": statistics.mean(s for _i, s in later) if later else None}


def whole_run_tokens_per_s(generations: list) -> Optional[float]:
    """Tokens over generation seconds, every generation counted (the first one's
    compilation and warm-up included)."""
    timed = [g for g in generations if g.get("tokens") is not None and g.get("generate_s")]
    seconds = sum(g["generate_s"] for g in timed)
    return sum(g["tokens"] for g in timed) / seconds if seconds > 0 else None


def amem_record(callback, rec: Recorder) -> Optional[dict]:
    """What the package did on this rank: each begin and end, kept groups, the
    headroom it told, its counters and the caller's waits."""
    if callback is None or callback.session is None:
        return None
    callback.session.settle()

    def rows(report):
        return [{"name": g.name, "action": getattr(g.action, "value", str(g.action)),
                 "reason": g.reason, "suspendable_bytes": g.suspendable_bytes,
                 "seconds": g.seconds} for g in report.groups]

    from tests.gpu.common import nccl_library

    headroom = callback.session.headroom
    inert = bool(callback.policy.metrics()["amem/inert"])
    begins = rec.reports["begin"]
    lib = nccl_library()
    # the backend as the last begin report names it (and, when the ranks found it
    # unusable, why nothing was done), and the NCCL it calls
    return {"backend": begins[-1].backend if begins else None, "inert": inert,
            "why_inert": begins[-1].skipped if inert and begins else None,
            "nccl_library": f"NCCL {lib.version_str} from {lib.path}" if lib else None,
            "kept": dict(callback.kept),
            "begins": [{"nccl_bytes": r.nccl_bytes, "device_freed_bytes": r.device_freed_bytes,
                        "device_shared_by": r.device_shared_by, "wall_s": r.wall_seconds,
                        "seconds": r.total_seconds, "skipped": r.skipped,
                        "waited_for_bytes": r.waited_for_bytes, "groups": rows(r)}
                       for r in rec.reports["begin"]],
            "ends": [{"wall_s": r.wall_seconds, "seconds": r.total_seconds, "groups": rows(r)}
                     for r in rec.reports["end"]],
            "headroom": None if headroom is None else {
                "setting": headroom.setting, "current": headroom.current,
                "suggested": headroom.suggested, "freed_bytes": headroom.freed_bytes,
                "total_bytes": headroom.total_bytes, "margin_bytes": headroom.margin_bytes,
                "line": headroom.line()},
            "waited": dict(callback.session.waited),
            "begins_not_needed": callback.session.metrics().get(
                "amem/total/begins_not_needed"),
            "begins_after_short_allocation": callback.session.metrics().get(
                "amem/total/begins_after_short_allocation"),
            "counters": callback.policy.metrics(last=False)}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "vllm", "triton", "torchvision", "transformers", "accelerate",
                    "trl", "datasets", "tokenizers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


def code_identity(commit: Optional[str]) -> dict:
    """The sha256 of the files this run's behaviour depends on, and ``commit``
    (common.provenance's: git's, else an export's, which ``--git-head`` gives) under
    its older name ``git_head``."""
    sums = {}
    for rel in CODE_FILES:
        try:
            with open(os.path.join(ROOT, rel), "rb") as f:
                sums[rel] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            sums[rel] = None
    return {"git_head": commit or "unknown: pass --git-head (the GPU machine's tree has no .git)",
            "code_sha256": sums}


def run_rank(args) -> int:
    """One rank of one training run; writes ``{prefix}.rank{R}.json``. Returns 0, or 3
    when the run failed (the JSON says where and how)."""
    import torch
    import torch.distributed as dist

    from tests.gpu.common import ON_CPU, StepTimer, bind_device, cpu_notes, gloo_group, \
        machine, nccl_library, policy_backend, provenance, ranks_per_gpu

    cpu = ON_CPU
    log = VllmLog()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = bind_device()  # on CPU: the torch.cuda stand-in the readings below use
    if not cpu:  # accelerate and trl (for vLLM) read LOCAL_RANK: the GPU this rank shares
        os.environ["LOCAL_RANK"] = str(device)
    torch.manual_seed(0)

    def free_now():
        return torch.cuda.mem_get_info(device)[0]

    def memory_now():  # after the work queued so far, as the allocation that follows sees it
        torch.cuda.synchronize()
        return free_now()

    def synchronize():
        if not cpu:
            torch.cuda.synchronize()

    rec = Recorder(free_now)
    record_transitions(rec)
    origin = provenance(DRIVER)  # under torchrun: its command line, as the orchestrator ran it
    out = {"rank": rank, "world": world, "args": vars(args), **origin,
           **code_identity(origin["commit"]), "versions": versions(), "failed": None}
    callback = trainer = ballast = None
    timer = StepTimer(synchronize)
    try:
        if cpu:
            use_stand_in_vllm()
        from trl import GRPOConfig, GRPOTrainer

        if not cpu:
            # vLLM 0.31 applies its dictConfig when the engine is built (LLMEngine's
            # configure_logging_if_needed), which drops a handler installed before, and
            # trl sets VLLM_LOGGING_LEVEL=ERROR: the first device run read no KV line. With
            # vLLM's own set-up off, its records reach this handler at INFO, and this
            # handler echoes them to the run's log.
            os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
            import vllm.logger  # noqa: F401
        log.install(echo=not cpu)

        from amem_callbacks.groups import name_group, register_roles

        AMemCallback = import_callback()

        register_roles([SYNC_ROLE])
        rec.stage = "model build"
        model = build_model(args, os.path.join(args.work, f"model-rank{rank}"))
        out["gpu_total_bytes"] = None if cpu else torch.cuda.mem_get_info(device)[1]
        if args.ballast_gib > 0 and not cpu:  # held for the whole run, like a training state
            ballast = torch.empty(int(args.ballast_gib * GIB), dtype=torch.uint8,
                                  device=f"cuda:{device}")
        out["ballast_bytes"] = 0 if ballast is None else ballast.numel()
        out["kv_bytes_per_token"] = kv_bytes_per_token(args)  # tokens <-> bytes of vLLM's cache
        config = GRPOConfig(
            output_dir=os.path.join(args.work, "out", f"rank{rank}"), bf16=not cpu, use_cpu=cpu,
            use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
            vllm_gpu_memory_utilization=args.share, vllm_max_model_length=args.max_model_len,
            per_device_train_batch_size=args.batch, steps_per_generation=args.steps_per_generation,
            num_generations=args.num_generations, max_completion_length=args.completion_length,
            max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no", seed=0,
            learning_rate=1e-5, beta=0.0, disable_tqdm=True,
            gradient_checkpointing=args.gradient_checkpointing,
            # every completion full length (min_tokens), token ids only (trl decodes itself)
            generation_kwargs={"min_tokens": args.completion_length, "detokenize": False})
        # Ranks sharing a GPU (and the CPU mode, so that this code runs somewhere
        # before a GPU): vLLM's start-up measurements one rank at a time.
        _ = config.device  # accelerate starts torch.distributed here: the store exists now
        shared = ranks_per_gpu() if not cpu else 1
        store = None
        if world > 1 and (shared > 1 or cpu):
            store = dist.distributed_c10d._get_default_store()
            out["vllm_turns"] = {}
            take_turns(store, rank, out["vllm_turns"], *(
                ((StandInLLM, "memory_snapshot"), (StandInLLM, "determine_available_memory"))
                if cpu else ()))
        note_vllm_start(out, memory_now, store, world)
        callbacks = [timer.callback]
        if args.amem:
            callback = AMemCallback(backend=policy_backend("nccl"), keep=[SYNC_ROLE])
            callbacks.append(callback)
        rec.stage = "start-up (GRPOTrainer: vllm.LLM, its KV cache, its first sleep)"
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                              train_dataset=dataset(args.prompt_words),
                              processing_class=tokenizer(), callbacks=callbacks)
        sync = gloo_group()
        name_group(sync, SYNC_ROLE)
        out["ranks_on_gpu"] = shared
        spy(trainer, rec, lambda: dist.barrier(group=sync), synced_sleep=shared > 1,
            memory_now=memory_now, short_wake=forced_short_wake(args, rank, shared, device,
                                                                callback, out))
        rec.stage = "train"
        rec.start_sampler()
        trainer.train()
        out["whole_run_s"] = time.monotonic() - PROCESS_STARTED  # start to the last step
        rec.stop_sampler()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        out.update(loss=[h["loss"] for h in logs], grad_norm=[h.get("grad_norm") for h in logs],
                   logged_amem_headroom=[h.get("amem/headroom/gpu_memory_utilization")
                                         for h in logs])
    except BaseException as exc:  # noqa: BLE001 - recorded, then the rank exits non-zero
        rec.stop_sampler()
        import traceback

        text = "".join(traceback.format_exception(exc))
        out["failed"] = {"stage": rec.stage, "error": f"{type(exc).__name__}: {exc}"[:1500],
                         "oom": failure_line(text.splitlines() + log.lines),
                         "traceback_tail": text[-4000:]}
    out.update(vllm=parse_vllm_lines(log.lines), generations=rec.generations,
               memory_minima=rec.minima(), step_seconds=timer.steps,
               **step_figures(timer.steps, args.steps_per_generation),
               whole_run_tokens_per_s=whole_run_tokens_per_s(rec.generations),
               machine=machine(),
               events=[{k: v for k, v in e.items() if k != "t"} for e in rec.events],
               amem=amem_record(callback, rec) if out["failed"] is None else None,
               nccl=getattr(nccl_library(), "version_str", None),
               device=None if cpu else torch.cuda.get_device_name(device), **cpu_notes())
    out["vllm"]["lines"] = [line for line in log.lines if any(
        p.search(line) for p in (KV_MEMORY, KV_TOKENS, SLEEP, WAKE))][:50]
    path = f"{args.prefix}.rank{rank}.json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    if out["failed"] is not None:
        print(f"rank {rank}: FAILED in {out['failed']['stage']}: {out['failed']['error'][:300]}",
              flush=True)
        return 3
    if callback is not None:
        callback.detach()
    print(f"rank {rank}: KV cache {out['vllm']['kv_cache_tokens']} tokens, generation "
          f"{[round(g.get('tokens_per_s') or 0) for g in rec.generations]} tokens/s", flush=True)
    if dist.is_initialized():
        dist.barrier(group=sync)
    return 0


# --- merging a run's ranks, and the orchestrator ---------------------------------------------
def failure_text(failed: Optional[dict], rc) -> str:
    """One line for a failed run: its out-of-memory line, else its ranks' errors."""
    failed = failed or {}
    oom = failed.get("oom")
    if oom:
        return f"{oom.get('kind')}: {oom.get('line')}" if isinstance(oom, dict) else str(oom)
    return "; ".join(sorted(set((failed.get("errors") or {}).values()))) or f"rc {rc}"


def merge_run(prefix: str, log_lines=(), meta: Optional[dict] = None) -> dict:
    """One run from its ranks' JSON (``prefix.rankN.json``) and its log: KV cache
    (the smallest rank's, as vLLM's external launcher takes the minimum), generation
    tokens/s (mean over ranks of each rank's mean after the first generation), step
    figures (the slowest rank), losses (rank 0), what failed and its out-of-memory line."""
    ranks = {}
    folder = os.path.dirname(prefix) or "."
    base = os.path.basename(prefix)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        m = re.fullmatch(re.escape(base) + r"\.rank(\d+)\.json", name)
        if m:
            with open(os.path.join(folder, name)) as f:
                ranks[int(m.group(1))] = json.load(f)
    run = dict(meta or {})
    # the ranks of one run are one launch: one commit, or the record is not this run's
    one_commit({f"rank {r}": d.get("commit") for r, d in ranks.items()})
    failures = {r: d["failed"] for r, d in ranks.items() if d.get("failed")}
    log_failure = failure_line(log_lines)
    world = (meta or {}).get("ranks") or (max(ranks) + 1 if ranks else 0)
    missing = [r for r in range(world) if r not in ranks]
    rc, hung = run.get("rc"), run.get("hung")
    # every rank wrote its figures after its last step, none failed: a bound that then
    # cut the launcher's exit (vLLM's engines shutting down) took nothing from the run
    clean = bool(ranks) and not failures and not missing
    finished = clean and all(len(d.get("loss") or []) == (d.get("args") or {}).get("steps")
                             for d in ranks.values())
    ok = clean and rc in (0, None) and not hung or finished
    if ok and rc not in (0, None):
        run["cut_after_finishing"] = True
    oom = next((f["oom"] for f in failures.values() if f.get("oom")), None) or log_failure
    run.update(ok=ok, ranks_reported=sorted(ranks), ranks_missing=missing,
               failed=None if ok else {
                   "stages": {r: f["stage"] for r, f in failures.items()},
                   "errors": {r: f["error"][:400] for r, f in failures.items()},
                   "oom": oom, "rc": rc, "hung": hung})

    for d in ranks.values():  # records older than the whole-run keys: from their own steps
        if d.get("whole_run_mean_step_s") is None and d.get("step_seconds"):
            d["whole_run_mean_step_s"] = statistics.mean(d["step_seconds"])
        if d.get("whole_run_tokens_per_s") is None and d.get("generations"):
            d["whole_run_tokens_per_s"] = whole_run_tokens_per_s(d["generations"])

    def values(key):
        return [d.get(key) for d in ranks.values() if d.get(key) is not None]

    kv = [d["vllm"]["kv_cache_bytes"] for d in ranks.values()
          if (d.get("vllm") or {}).get("kv_cache_bytes") is not None]
    tokens = [d["vllm"]["kv_cache_tokens"] for d in ranks.values()
              if (d.get("vllm") or {}).get("kv_cache_tokens") is not None]
    per_rank_rate = []
    for d in ranks.values():
        rates = [g["tokens_per_s"] for g in (d.get("generations") or [])[1:]
                 if g.get("tokens_per_s")]
        if rates:
            per_rank_rate.append(statistics.mean(rates))
    minima = [m["min_free_generating"] for d in ranks.values()
              for m in (d.get("memory_minima") or [])[1:] if m.get("min_free_generating")]
    train_minima = [m["min_free_training_after"] for d in ranks.values()
                    for m in (d.get("memory_minima") or [])[1:] if m.get("min_free_training_after")]
    # the margin's question (session J): what a generation needs beyond its KV wake-up
    # at its peak (torch's own counter, this rank's) against what the free memory after
    # generate shows (the GPU's: this rank's part of it where ranks share the GPU, as
    # the package's begin reads it for its estimate)
    later = [(g, max(1, d.get("ranks_on_gpu") or 1))
             for d in ranks.values() for g in (d.get("generations") or [])[1:]]
    peaks = [g["torch_peak_beyond_kv_wake"] for g, _ in later
             if g.get("torch_peak_beyond_kv_wake") is not None]
    drops = [(g["free_after_kv_wake"] - g["free_after_generate"]) // sharing
             for g, sharing in later
             if g.get("free_after_kv_wake") is not None
             and g.get("free_after_generate") is not None]
    first = ranks.get(min(ranks)) if ranks else {}
    amem = [d["amem"] for d in ranks.values() if d.get("amem")]
    headrooms = [a["headroom"] for a in amem if a.get("headroom")]
    whole_rates = values("whole_run_tokens_per_s")
    run.update(
        # whole-run figures first: the slowest rank's start-to-last-step and mean step
        # over every step, tokens/s over every generation (warm-up included)
        whole_run_s=max(values("whole_run_s"), default=None),
        whole_run_mean_step_s=max(values("whole_run_mean_step_s"), default=None),
        whole_run_tokens_per_s=statistics.mean(whole_rates) if whole_rates else None,
        kv_cache_bytes=min(kv) if kv else None, kv_cache_tokens=min(tokens) if tokens else None,
        tokens_per_s=statistics.mean(per_rank_rate) if per_rank_rate else None,
        generation_step_s=max(values("generation_step_s"), default=None),
        train_step_s=max(values("train_step_s"), default=None),
        mean_step_s=max(values("mean_step_s"), default=None),
        loss=(first or {}).get("loss"),
        min_free_generating=min(minima) if minima else None,
        min_free_training=min(train_minima) if train_minima else None,
        generation_torch_peak_bytes=max(peaks, default=None),
        generation_free_drop_bytes=max(drops, default=None),
        gpu_total_bytes=(first or {}).get("gpu_total_bytes"),
        ranks_on_gpu=(first or {}).get("ranks_on_gpu"),
        at_vllm_start=(first or {}).get("at_vllm_start"),
        nccl_bytes=min((b["nccl_bytes"] for a in amem for b in a["begins"] if b["nccl_bytes"]),
                       default=None),
        headroom_suggested=min((h["suggested"] for h in headrooms), default=None),
        headroom_line=headrooms[0]["line"] if headrooms else None,
        versions=(first or {}).get("versions"), machine=(first or {}).get("machine"),
        commit=(first or {}).get("commit"),
        git_head=(first or {}).get("git_head"),
        command=run.get("command") or (first or {}).get("command"))
    return run


def edge_plan(probe: dict, kv_target_gib: float, slack_gib: float,
              probe_share: float = TRL_DEFAULT_SHARE) -> dict:
    """From a probe run without the package (share ``probe_share``, no ballast): the
    share and the per-rank ballast that give vLLM a KV cache of ``kv_target_gib`` and
    leave ``slack_gib`` of the GPU free at its fullest, as a share tuned to the edge
    of what fits without the package.

    vLLM's cache is share x total less what the engine uses besides it, so it moves by
    (share - probe_share) x total per rank; every rank on the GPU takes that and its
    ballast from the GPU's free memory. The readings are GPU-wide and the ranks do not
    change phase together: a rank's lowest reading "while training" came while the
    other one generated (session I, one H100: 18.46 GB in both). So the GPU's lowest
    reading of either phase moves with the share, and training alone (vLLM asleep)
    is left to the calibration run (:func:`calibrated`). When the ballast would be
    negative the share is what the slack allows (the cache is then larger than asked)."""
    n = probe.get("ranks_on_gpu") or 1
    total, kv = probe.get("gpu_total_bytes"), probe.get("kv_cache_bytes")
    gen, train = probe.get("min_free_generating"), probe.get("min_free_training")
    if not all(isinstance(x, (int, float)) for x in (total, kv, gen)):
        raise ValueError(f"the probe lacks a figure edge_plan needs: total {total}, KV {kv}, "
                         f"free while generating {gen}, while training {train} (did it run "
                         "two generations?)")
    low = min(x for x in (gen, train) if isinstance(x, (int, float)))
    share = probe_share + (kv_target_gib * GIB - kv) / total
    ballast = (low - n * (share - probe_share) * total - slack_gib * GIB) / n
    why = "the KV target"
    if ballast < 0:
        ballast = 0.0
        share = probe_share + (low - slack_gib * GIB) / (n * total)
        why = "the slack (no ballast): the KV cache is larger than the target"
    share = int(share * 10**4) / 10**4  # down: vLLM takes any float; the edge must fit
    if share <= 0:
        raise ValueError(f"no share fits: the probe left {low / GIB:.2f} GiB free at its "
                         f"fullest on {n} ranks; lower --slack-gib or --kv-target-gib")
    return {"share": share, "ballast_gib": round(ballast / GIB, 3), "set_by": why,
            "expected_kv_gib": round((kv + (share - probe_share) * total) / GIB, 3),
            "ranks_on_gpu": n, "probe_share": probe_share}


#: the calibration run leaves this much more of the GPU free than the plan (GiB, all
#: ranks together), twice as much again after each try that ran out of memory: the
#: probe's 20 ms readings miss short peaks (session J, one H100: the plan's own ballast,
#: 0.5 GiB of slack, ran out of memory in the first generation)
CALIBRATION_ROOM_GIB = 2.0
CALIBRATION_TRIES = 3


def calibration_ballast(plan: dict, tries_failed: int) -> float:
    """The calibration run's ballast a rank: the plan's, less its share of the room."""
    room = CALIBRATION_ROOM_GIB * 2 ** tries_failed / (plan.get("ranks_on_gpu") or 1)
    return max(0.0, int((plan["ballast_gib"] - room) * 1000) / 1000)


def calibrated(plan: dict, calibration: dict, slack_gib: float) -> dict:
    """The plan once a run at its share (package off) has measured the GPU's lowest
    free memory: the ballast is that run's, moved by what the reading is off the slack
    (shared among the ranks), so the default share sits at the edge however the probe's
    arithmetic missed (vLLM's profile of a smaller engine, training alone)."""
    low = min((x for x in (calibration.get("min_free_generating"),
                           calibration.get("min_free_training"))
               if isinstance(x, (int, float))), default=None)
    if low is None:
        raise ValueError("the calibration run has no free-memory reading (did it run two "
                         "generations?)")
    n = plan.get("ranks_on_gpu") or 1
    ran_with = calibration.get("ballast_gib", plan["ballast_gib"])
    ballast = max(0.0, ran_with + (low / GIB - slack_gib) / n)
    return dict(plan, ballast_gib=int(ballast * 1000) / 1000,
                planned_ballast_gib=plan["ballast_gib"],
                calibration_min_free_gib=round(low / GIB, 3))


def raised_shares(default_amem: dict, share: float) -> dict:
    """The raised shares to try, from the package's run at the default share:
    ``headroom`` is what its headroom line recommends (amem/headroom/gpu_memory_utilization,
    rounded down to 0.01 by the package); ``per_rank`` adds this rank's own suspended
    bytes less the package's margin, to 1e-4 (on a shared GPU the headroom line counts
    the bytes every rank freed for each rank's engine)."""
    from amem_callbacks.headroom import DEFAULT_MARGIN_BYTES

    out = {"headroom": default_amem.get("headroom_suggested"), "per_rank": None}
    total, freed = default_amem.get("gpu_total_bytes"), default_amem.get("nccl_bytes")
    if total and freed:
        out["per_rank"] = int((share + max(0, freed - DEFAULT_MARGIN_BYTES) / total) * 10**4) / 10**4
    return out


#: how many times the raised share follows the package's headroom line from the run
#: before while the share before still fitted without the package (session J, one
#: H100: the first step, +0.66 GiB a rank, fitted in what the edge left; the second failed)
HEADROOM_STEPS = 3


def headroom_variant(step: int) -> str:
    """The variant of the headroom line's ``step`` (1: the line at the default share)."""
    return "raised_headroom" if step == 1 else f"raised_headroom_{step}"


def headroom_variants(variants) -> list:
    """The headroom line's steps among ``variants``, in order."""
    named = {headroom_variant(step): step for step in range(1, HEADROOM_STEPS + 1)}
    steps = [v for v in variants if v in named or v.startswith("raised_headroom_")]
    return sorted(steps, key=lambda v: named[v] if v in named else int(v.rsplit("_", 1)[1]))


def pair_order(index: int) -> tuple:
    """ABBA: which of the pair runs first alternates, so neither always meets a
    fresh or a warm machine."""
    return (True, False) if index % 2 == 0 else (False, True)


def plan_runs(state: dict, args) -> list:
    """The runs still to make, in order, from what ``state`` holds: the probe, the
    calibration, the first default pair, the raised pairs (once the package ran at
    the default share), then the other default pairs.
    Each: {name, share, amem, ballast_gib, variant}."""
    runs = state.setdefault("runs", {})
    todo = []
    if args.share is None and "probe" not in runs:
        return [{"name": "probe", "share": args.probe_share, "amem": False, "ballast_gib": 0.0,
                 "variant": "probe"}]
    if args.share is not None:
        default, ballast = args.share, args.ballast_gib
    else:
        plan = state.get("edge") or edge_plan(runs["probe"], args.kv_target_gib, args.slack_gib,
                                              probe_share=args.probe_share)
        state["edge"] = plan
        failed = state.setdefault("failed_calibrations", [])
        if "calibration_min_free_gib" not in plan and "calibrate" in runs \
                and not runs["calibrate"].get("ok"):
            if not (runs["calibrate"].get("failed") or {}).get("oom") \
                    or len(failed) + 1 >= CALIBRATION_TRIES:
                raise SystemExit("the calibration run failed at share "
                                 f"{plan['share']} with {runs['calibrate']['ballast_gib']} GiB of "
                                 f"ballast a rank: {runs['calibrate'].get('failed')}; run the "
                                 "same command with a larger --slack-gib (the state keeps the "
                                 "probe)")
            failed.append(runs.pop("calibrate"))  # out of memory: again with more room
        if "calibrate" not in runs:  # the plan's own run, package off, before any pair
            return [{"name": "calibrate", "share": plan["share"], "amem": False,
                     "ballast_gib": calibration_ballast(plan, len(failed)),
                     "variant": "calibrate"}]
        if "calibration_min_free_gib" not in plan:
            plan = state["edge"] = calibrated(plan, runs["calibrate"], args.slack_gib)
        default, ballast = plan["share"], plan["ballast_gib"]
    state["shares"] = dict(state.get("shares") or {}, default=default)
    if args.search_step:
        return [r for r in search_runs(state, args, default, ballast) if r["name"] not in runs]
    defaults = [{"name": f"default-{'amem' if amem else 'base'}-{i}", "share": default,
                 "amem": amem, "ballast_gib": ballast, "variant": "default"}
                for i in range(args.pairs) for amem in pair_order(i)]
    # the first default pair, then the raised shares (the key: whether they
    # fail without the package), then the other default pairs: a session whose device
    # time runs out still has one pair at each share
    todo.extend(defaults[:2])
    first_amem = runs.get("default-amem-0")
    if first_amem and first_amem.get("ok"):
        raised = raised_shares(first_amem, default)
        seen = {default}

        def raise_to(variant: str, share) -> None:
            state["shares"][variant] = share
            if share is None or share in seen:
                return  # nothing to raise to, or the same run as another variant
            seen.add(share)
            for i in range(args.raised_pairs):
                for amem in reversed(pair_order(i)):  # the run without the package first
                    todo.append({"name": f"{variant}-{'amem' if amem else 'base'}-{i}",
                                 "share": share, "amem": amem, "ballast_gib": ballast,
                                 "variant": variant})

        raise_to(headroom_variant(1), raised["headroom"])
        # as a user follows the headroom line: where the raised share still fitted
        # without the package, the package's run there recommends the next one
        for step in range(2, HEADROOM_STEPS + 1):
            previous = headroom_variant(step - 1)
            base, amem = runs.get(f"{previous}-base-0"), runs.get(f"{previous}-amem-0")
            if not (base and base.get("ok") and amem and amem.get("ok")):
                break  # not run yet, or it failed without the package: the edge is found
            raise_to(headroom_variant(step), amem.get("headroom_suggested"))
        raise_to("raised_per_rank", raised["per_rank"])
    todo.extend(defaults[2:])
    return [r for r in todo if r["name"] not in runs]


def fits(run: dict) -> Optional[bool]:
    """True where the run finished, False where it ran out of memory, else None (cut
    or crashed: it says nothing about fitting)."""
    if run.get("ok"):
        return True
    return False if (run.get("failed") or {}).get("oom") else None


def search_of(state: dict, side: str, low: float, args) -> Search:
    """The search of one side (``base`` or ``amem``), replayed from its runs."""
    search = Search(low, args.search_step, max(low, args.search_high))
    for name, run in sorted(state["runs"].items()):
        if name.startswith(f"search-{side}-"):
            search.record(run["share"], fits(run))
    return search


def search_runs(state: dict, args, default: float, ballast: float) -> list:
    """The yardstick (issue 59): the largest share that runs without the package, on
    the grid default + k * --search-step up to --search-high; then the largest that
    runs with it, from there on the same grid; then --pairs interleaved pairs of the
    two (``best-base-i`` against ``raised-amem-i``), ABBA. The searches, their
    failures included, stay in the state ("search")."""
    found = {}
    for side, amem in (("base", False), ("amem", True)):
        low = default if side == "base" else found["base"]
        search = search_of(state, side, low, args)
        state.setdefault("search", {})[side] = search.as_dict()
        if search.stuck():
            raise SystemExit(f"the search {'with' if amem else 'without'} the package: "
                             f"{search.stuck()}")
        value = search.next()
        if value is not None:
            tries = len(search.trials.get(value, []))
            return [{"name": f"search-{side}-{value:g}" + (f"-{tries}" if tries else ""),
                     "share": value, "amem": amem, "ballast_gib": ballast,
                     "variant": f"search_{side}"}]
        found[side] = search.largest_fit
    state["shares"].update(best=found["base"], raised=found["amem"])
    return [{"name": f"{'raised' if amem else 'best'}-{'amem' if amem else 'base'}-{i}",
             "share": found["amem"] if amem else found["base"], "amem": amem,
             "ballast_gib": ballast, "variant": "raised" if amem else BEST_WITHOUT}
            for i in range(args.pairs) for amem in pair_order(i)]


def summarise(state: dict) -> dict:
    """The pairs side by side: per share variant, each run's KV cache, tokens/s, step
    time and outcome; ratios against the default share's runs without the package; and
    whether each raised share fails without the package (every run of it without the
    package ran out of memory) and runs with it."""
    runs = state.get("runs", {})
    shares = state.get("shares", {})
    by_variant: dict = {}
    for name, run in runs.items():
        by_variant.setdefault(run.get("variant", "?"), {"amem": [], "base": []})[
            "amem" if run.get("amem") else "base"].append(name)
    base_default = [runs[n] for n in by_variant.get("default", {}).get("base", []) if runs[n]["ok"]]

    def mean_of(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.mean(vals) if vals else None

    reference = {k: mean_of(base_default, k) for k in ("kv_cache_tokens", "tokens_per_s",
                                                       "mean_step_s", "generation_step_s")}
    variants = {}
    for variant, names in sorted(by_variant.items()):
        rows = {}
        for side in ("amem", "base"):
            for name in names[side]:
                r = runs[name]
                ratio = {k: (r[k] / reference[k] if r.get(k) and reference.get(k) else None)
                         for k in reference}
                rows[name] = {"amem": side == "amem", "share": r.get("share"), "ok": r["ok"],
                              "kv_cache_tokens": r.get("kv_cache_tokens"),
                              "kv_cache_gib": _gib(r.get("kv_cache_bytes")),
                              "tokens_per_s": r.get("tokens_per_s"),
                              "mean_step_s": r.get("mean_step_s"),
                              "generation_step_s": r.get("generation_step_s"),
                              # beyond the KV wake-up: torch's peak, the free memory's drop
                              "generation_peak_gib": _gib(r.get("generation_torch_peak_bytes")),
                              "generation_drop_gib": _gib(r.get("generation_free_drop_bytes")),
                              "vs_default_without": ratio,
                              "failed": r.get("failed")}
        variants[variant] = rows
    fails_without, runs_with, lines = {}, {}, {}
    steps = headroom_variants(set(by_variant) | {"raised_headroom"})
    for variant in steps + ["raised_per_rank"]:
        base = [runs[n] for n in by_variant.get(variant, {}).get("base", [])]
        amem = [runs[n] for n in by_variant.get(variant, {}).get("amem", [])]
        fails_without[variant] = (all(not r["ok"] and (r.get("failed") or {}).get("oom")
                                      for r in base) if base else None)
        runs_with[variant] = all(r["ok"] for r in amem) if amem else None
        lines[variant] = [(r.get("failed") or {}).get("oom") for r in base + amem
                          if not r["ok"]]
    same_share_losses = {}
    for variant, names in by_variant.items():
        ok = [runs[n] for n in names["amem"] + names["base"] if runs[n]["ok"] and runs[n].get("loss")]
        if len(ok) > 1:
            same_share_losses[variant] = max(
                abs(a - b) for r in ok[1:] for a, b in zip(r["loss"], ok[0]["loss"]))
    # the verdict: the first step of the headroom line that did not fit without the
    # package (False where every step tried fitted, None where none ran)
    tried = [v for v in steps if fails_without.get(v) is not None]
    verdict = next((v for v in tried if fails_without[v]), tried[-1] if tried else None)
    return {"shares": shares, "edge": state.get("edge"), "variants": variants,
            "reference_default_without": reference,
            "raised_share_fails_without": fails_without.get(verdict) if verdict else None,
            "raised_share": {"variant": verdict, "share": shares.get(verdict),
                             "runs_with": runs_with.get(verdict),
                             "failure_lines": lines.get(verdict, [])} if verdict else None,
            "headroom_steps": [{"variant": v, "share": shares.get(v),
                                "fails_without": fails_without.get(v),
                                "runs_with": runs_with.get(v)} for v in steps if v in by_variant],
            "raised_share_fails_without_by_variant": fails_without,
            "raised_share_runs_with": runs_with, "failure_lines": lines,
            "max_loss_difference_at_one_share": same_share_losses,
            "pairs": interleaved_pairs(runs), "search": state.get("search"),
            "runs_done": sorted(runs), "runs_planned_next": state.get("next", [])}


#: whole-run figures first (the headline), then the steady state's (first generation out)
PAIR_KEYS = ("whole_run_mean_step_s", "whole_run_tokens_per_s", "whole_run_s",
             "kv_cache_tokens", "tokens_per_s", "mean_step_s")
#: the variant of the largest share that ran without the package (the search's):
#: a run with the package is compared with it wherever its own share failed without
BEST_WITHOUT = "best"


def interleaved_pairs(runs: dict) -> dict:
    """Each run with the package against the run without it of the same pair index:
    at the same share where that run finished, else (the raised share ran out of
    memory without the package) at the largest share that ran without it (the
    ``best`` variant, the search's), else, in records older than the search, at the
    default share (said in the pair: ``against``). A pair counts only where both
    ran the same number of steps (a mean step over 32 steps weighs its generations
    otherwise than one over 48) with one commit. Per variant: the pairs, and the
    median and range of each ratio over the pairs that count."""
    out = {}
    for name in sorted(runs):
        run = runs[name]
        variant, _, index = name.rpartition("-amem-")
        if not (variant and index.isdigit() and run.get("amem") and run.get("ok")):
            continue
        candidates = [(f"{variant}-base-{index}", "the same share"),
                      (f"{BEST_WITHOUT}-base-{index}", "the largest share that ran without"),
                      (f"default-base-{index}", "the default share (not the best without)")]
        without, against_what = next(((n, why) for n, why in candidates
                                      if (runs.get(n) or {}).get("ok")), (None, None))
        if without is None:
            continue
        against = runs[without]
        steps = (len(run.get("loss") or []), len(against.get("loss") or []))
        same_code = run.get("commit") == against.get("commit") or not (
            run.get("commit") and against.get("commit"))  # records before commits: as before
        ratio = {k: (round(run[k] / against[k], 4) if run.get(k) and against.get(k) else None)
                 for k in PAIR_KEYS}
        out.setdefault(variant, {"pairs": []})["pairs"].append(
            {"with": name, "without": without, "without_share": against.get("share"),
             "against": against_what, "steps": list(steps), "same_commit": same_code,
             "counts": steps[0] == steps[1] and steps[0] > 0 and same_code, "ratio": ratio})
    for rows in out.values():
        counted = [p["ratio"] for p in rows["pairs"] if p["counts"]]
        rows["counted"] = len(counted)
        for k in PAIR_KEYS:
            vals = sorted(r[k] for r in counted if r[k] is not None)
            rows[k] = ({"median": round(statistics.median(vals), 4), "min": vals[0],
                        "max": vals[-1]} if vals else None)
    return out


def _gib(nbytes: Optional[int]) -> Optional[float]:
    return None if nbytes is None else round(nbytes / GIB, 3)


def driver_flags(args, steps: Optional[int] = None) -> list:
    """The ``run`` flags the orchestrator passes through to every run (``steps``: this
    run's, where it is not ``--steps``)."""
    return ["--steps", str(steps or args.steps), "--batch", str(args.batch),
            "--steps-per-generation", str(args.steps_per_generation),
            "--num-generations", str(args.num_generations),
            "--completion-length", str(args.completion_length),
            "--max-model-len", str(args.max_model_len), "--prompt-words", str(args.prompt_words),
            "--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
            "--kv-heads", str(args.kv_heads),
            *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
            *(["--git-head", args.git_head] if args.git_head else [])]


def run_steps(spec: dict, args) -> int:
    """A search run's steps are ``--search-steps`` where given: it only has to say
    whether the share fits; the pairs' runs, whose figures are reported, run ``--steps``."""
    searching = spec.get("variant", "").startswith("search_")
    return (getattr(args, "search_steps", None) or args.steps) if searching else args.steps


def start_run(spec: dict, args, folder: str, env: dict):
    """One bounded torchrun of ``run``; returns (process, argv, log path, started)."""
    os.makedirs(folder, exist_ok=True)
    from amem_callbacks.tools.launch import free_port

    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
            "--master-port", str(free_port()), DRIVER,
            "run", os.path.join(folder, "rank"), "--share", str(spec["share"]),
            "--amem" if spec["amem"] else "--no-amem", "--ballast-gib", str(spec["ballast_gib"]),
            "--work", os.path.join(folder, "work"), *driver_flags(args, run_steps(spec, args))]
    log_path = os.path.join(folder, "log.txt")
    log = open(log_path, "w")
    # torchrun starts each rank in a session of its own: a killpg of the run misses them
    # (measured: a failed run's ranks held 78 GiB after it, and the next two runs ran out
    # of memory at their model build), so every process of the run carries a tag
    from experiments import gpu_runs as megatron_runs

    tag = f"{spec['name']}-{os.getpid()}-{time.time_ns()}"
    proc = subprocess.Popen(argv, cwd=ROOT, env={**env, megatron_runs.RUN_TAG: tag}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    proc.run_tag = tag
    return proc, argv, log_path, log


def failed_ranks(folder: str) -> list:
    """Ranks whose JSON (written whole, through a rename) says the run failed."""
    out = []
    for name in os.listdir(folder):
        m = re.fullmatch(r"rank\.rank(\d+)\.json", name)
        if m:
            with open(os.path.join(folder, name)) as f:
                if json.load(f).get("failed"):
                    out.append(int(m.group(1)))
    return out


def wait_run(proc, folder: str, timeout_s: float, grace_s: float = 45) -> tuple:
    """Exit code and whether it hung. A rank that failed writes its JSON and exits; its
    peers may wait in a collective for it: ``grace_s`` later the run is ended."""
    began, failed_at, hung = time.monotonic(), None, False
    while proc.poll() is None:
        now = time.monotonic()
        if failed_at is None and failed_ranks(folder):
            failed_at = now
        if now - began > timeout_s or (failed_at and now - failed_at > grace_s):
            hung = now - began > timeout_s
            break
        time.sleep(1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's session (and compile workers)
    except ProcessLookupError:
        pass
    proc.wait()
    if getattr(proc, "run_tag", None):  # the ranks, in sessions of their own
        from experiments import gpu_runs as megatron_runs

        megatron_runs.kill_tagged(proc.run_tag)
    return proc.returncode, hung


def gpu_holders() -> list:
    """(pid, MiB) of every other process holding GPU memory, from nvidia-smi (this one
    may hold a CUDA context: gpu_total_now); [] where there is no nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [line.split(",") for line in out.stdout.splitlines() if line.strip()]
    return [(int(pid), int(mib)) for pid, mib in rows if pid.strip().isdigit()
            and mib.strip().isdigit() and int(pid) != os.getpid()] if out.returncode == 0 else []


def wait_for_free_gpu(wait_s: float = 60) -> list:
    """Until no process holds GPU memory (a run's ranks take some seconds to release
    it), at most ``wait_s``; returns the holders left. The CPU mode's runs use no GPU:
    nothing is in their way (on a GPU host, the test suite's own CUDA work would be)."""
    from tests.gpu.common import ON_CPU

    if ON_CPU:
        return []
    deadline = time.monotonic() + wait_s
    while True:
        holders = gpu_holders()
        if not holders or time.monotonic() >= deadline:
            return holders
        time.sleep(2)


def gpu_total_now() -> Optional[int]:
    """This machine's GPU total (None without CUDA): a probe of another card is no use."""
    import torch

    return torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None


def seed_probe(state: dict, path: str, total: Optional[int], now: dict,
               workload: Optional[list] = None) -> str:
    """Take the probe (and the run-time estimate) of an earlier call's state.json where
    it ran on a GPU of the same total memory with the same torch, vLLM and trl, and
    the same ``workload`` (the run flags, :func:`driver_flags` less ``--git-head``): a
    probe is a run of about 135 s, and the calibration run corrects the plan anyway.
    Says what it did."""
    try:
        earlier = json.load(open(path))
    except (OSError, ValueError) as exc:
        return f"--probe-from {path}: not read ({exc}); probing"
    probe = (earlier.get("runs") or {}).get("probe")
    if not probe or not probe.get("ok"):
        return f"--probe-from {path}: no successful probe there; probing"
    differs = [k for k in ("torch", "vllm", "trl")
               if (probe.get("versions") or {}).get(k) != now.get(k)]
    if total is None or probe.get("gpu_total_bytes") != total or differs:
        return (f"--probe-from {path}: its GPU ({probe.get('gpu_total_bytes')} bytes) or "
                f"versions ({differs}) differ from this one ({total} bytes); probing")
    if workload is not None and shlex.join(workload) not in probe.get("command", ""):
        return (f"--probe-from {path}: its run flags differ from this one's "
                f"({shlex.join(workload)}); probing")
    state.setdefault("runs", {})["probe"] = dict(probe, probe_from=path)
    if earlier.get("estimate_s"):
        state.setdefault("estimate_s", earlier["estimate_s"])
    return f"--probe-from {path}: its probe stands for this one (same GPU and versions)"


def orchestrate(args) -> int:
    """Make the runs ``plan_runs`` lists, one at a time, until none is left or the next
    one would not end inside ``--budget-s``; the state (and so the next call's start) is
    ``--state``/state.json; ``--out`` gets the summary and each run's merged JSON."""
    from tests.gpu import vllm_bundle

    os.makedirs(args.state, exist_ok=True)
    state_path = os.path.join(args.state, "state.json")
    state = json.load(open(state_path)) if os.path.isfile(state_path) else {}
    if args.probe_from and "probe" not in state.get("runs", {}):
        workload = driver_flags(argparse.Namespace(**dict(vars(args), git_head=None)))
        print(seed_probe(state, args.probe_from, gpu_total_now(), versions(), workload),
              flush=True)
    env = vllm_bundle.environment()
    began = time.monotonic()
    while True:
        todo = plan_runs(state, args)
        state["next"] = [r["name"] for r in todo]
        write_outputs(state, state_path, args.out)
        if not todo:
            print("all runs done")
            return 0
        spec = todo[0]
        left = args.budget_s - (time.monotonic() - began)
        estimate = state.get("estimate_s", args.run_timeout_s)
        if left < min(estimate, args.run_timeout_s):
            print(f"stopping: {left:.0f} s left of --budget-s, a run takes about {estimate:.0f} s; "
                  f"run the same command again for: {', '.join(state['next'])}")
            return 0
        holders = wait_for_free_gpu()
        if holders:  # a run beside them measures nothing: stop before it, not after
            print(f"stopping: processes still hold GPU memory (pid, MiB): {holders}; end them "
                  f"and run the same command again for: {', '.join(state['next'])}", flush=True)
            return 1
        folder = os.path.join(args.state, "runs", spec["name"])
        shutil.rmtree(folder, ignore_errors=True)  # a run cut off by the last call starts over
        print(f"run {spec['name']}: share {spec['share']}, package {'on' if spec['amem'] else 'off'}, "
              f"ballast {spec['ballast_gib']} GiB", flush=True)
        started = time.monotonic()
        proc, argv, log_path, log = start_run(spec, args, folder, env)
        rc, hung = wait_run(proc, folder, min(args.run_timeout_s, left))
        log.close()
        lines = open(log_path, errors="replace").read().splitlines()
        run = merge_run(os.path.join(folder, "rank"), lines,
                        dict(spec, rc=rc, hung=hung, ranks=args.ranks, command=shlex.join(argv),
                             seconds=round(time.monotonic() - started, 1)))
        run["log_tail"] = "\n".join(lines[-40:])
        state["runs"][spec["name"]] = run
        if run["ok"]:  # the longest good run so far, with a margin, bounds the next start
            state["estimate_s"] = max(state.get("estimate_s", 0), run["seconds"] * 1.15)
        print(f"  {'ok' if run['ok'] else 'FAILED'}: KV {run['kv_cache_tokens']} tokens, "
              f"{run['tokens_per_s'] and round(run['tokens_per_s'])} tokens/s"
              + ("" if run["ok"] else "; " + failure_text(run["failed"], rc)), flush=True)
        if spec["variant"] == "probe" and not run["ok"]:
            # every later run is sized from the probe: stop here (its log comes back),
            # and let the same command run it again once the cause is mended
            write_outputs(state, state_path, args.out)
            del state["runs"]["probe"]
            write_outputs(state, state_path, None)
            print("stopping: the probe failed, so nothing can be sized from it:\n"
                  + "\n".join(lines[-25:]), flush=True)
            return 1


def write_outputs(state: dict, state_path: str, out: Optional[str]) -> None:
    from tests.gpu.common import provenance

    with open(state_path + ".tmp", "w") as f:
        json.dump(state, f, indent=1, default=str)
    os.replace(state_path + ".tmp", state_path)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "summary.json"), "w") as f:  # the orchestrator's command
            json.dump(dict(summarise(state), **provenance(DRIVER)), f, indent=1, default=str)
        with open(os.path.join(out, "runs.json"), "w") as f:
            json.dump(state.get("runs", {}), f, indent=1, default=str)
        shutil.copyfile(state_path, os.path.join(out, "state.json"))
        pack_logs(os.path.join(os.path.dirname(state_path), "runs"),
                  os.path.join(out, "logs.tgz"))


def pack_logs(runs: str, target: str) -> None:
    """Every run's log and rank JSON (not its model folder) in one archive: a device
    call brings back at most 8 files (session I lost two rank files to that)."""
    import tarfile

    if not os.path.isdir(runs):
        return
    with tarfile.open(target + ".tmp", "w:gz") as tar:
        for name in sorted(os.listdir(runs)):
            folder = os.path.join(runs, name)
            for leaf in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
                if leaf == "log.txt" or re.fullmatch(r"rank\.rank\d+\.json", leaf):
                    tar.add(os.path.join(folder, leaf), arcname=f"{name}/{leaf}")
    os.replace(target + ".tmp", target)


# --- the command line --------------------------------------------------------------------------
def add_run_flags(p, *, orchestrator: bool) -> None:
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--steps-per-generation", type=int, default=4,
                   help="vLLM generates batch x this per rank at once (max_num_seqs)")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--completion-length", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="training activations small next to vLLM's cache")
    p.add_argument("--git-head", help="the commit this tree is, where it has no .git (the GPU "
                   "machine's copy): common.run_commit's AMEM_COMMIT")
    if not orchestrator:
        p.add_argument("--share", type=float, default=TRL_DEFAULT_SHARE,
                       help="vllm_gpu_memory_utilization")
        p.add_argument("--amem", action=argparse.BooleanOptionalAction, default=True,
                       help="AMemCallback(backend='nccl') on (--no-amem: off)")
        p.add_argument("--ballast-gib", type=float, default=0.0,
                       help="device memory each rank holds for the whole run")
        p.add_argument("--work", default="/tmp/amem-trl-vllm")
        p.add_argument("--short-wake", type=parse_short_wake, metavar="G:R",
                       help="take GPU memory before generation G's KV wake-up on rank R, "
                            "where the package skipped its begin (tests/gpu/short_wake.py)")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="one training run (under torchrun)")
    p.add_argument("prefix", help="each rank writes PREFIX.rankN.json")
    add_run_flags(p, orchestrator=False)
    p = sub.add_parser("pairs", help="probe, then interleaved pairs at the default and raised shares")
    p.add_argument("--state", default="/tmp/trl-vllm")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--share", type=float, help="the default share (skips the probe)")
    p.add_argument("--ballast-gib", type=float, default=0.0, help="with --share")
    p.add_argument("--probe-share", type=float, default=TRL_DEFAULT_SHARE)
    p.add_argument("--probe-from", help="an earlier call's state.json: its probe stands in "
                   "where the GPU and versions are the same (saves a run)")
    p.add_argument("--kv-target-gib", type=float, default=1.0)
    p.add_argument("--slack-gib", type=float, default=1.5,
                   help="free GPU memory (all ranks) the 20 ms readings leave at the default "
                        "share; it must stay below what the raised share adds, and cover the "
                        "peaks the readings miss (0.5 ran out of memory on one H100)")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--raised-pairs", type=int, default=1)
    p.add_argument("--search-step", type=float, default=None,
                   help="search the largest share that runs without the package, then with "
                        "it, on the grid default + k * STEP, then pair the two (--pairs)")
    p.add_argument("--search-high", type=float, default=None,
                   help="the grid's top (with --search-step)")
    p.add_argument("--search-steps", type=int, default=None,
                   help="a search run's steps (default --steps): at least two generations "
                        "(2 x --steps-per-generation), since the second KV wake-up is the "
                        "first beside the optimizer's state")
    p.add_argument("--run-timeout-s", type=float, default=420)
    p.add_argument("--budget-s", type=float, default=540, help="stop starting runs past this")
    add_run_flags(p, orchestrator=True)
    p = sub.add_parser("merge", help="one run's rank JSON files into one")
    p.add_argument("prefix")
    p.add_argument("--log")
    args = parser.parse_args(argv)
    if args.command == "pairs" and args.search_step is not None and (
            args.search_step <= 0 or args.search_high is None):
        parser.error(f"--search-step {args.search_step} needs a step > 0 and --search-high, "
                     "the grid's top: e.g. --search-step 0.0039 --search-high 0.0465")
    if args.command == "pairs" and args.search_steps is not None and \
            args.search_steps < 2 * args.steps_per_generation:
        parser.error(f"--search-steps {args.search_steps} is under two generations: the "
                     "first KV wake-up comes before the optimizer's state exists, so a share "
                     f"that fits there may not later; write --search-steps "
                     f"{2 * args.steps_per_generation} or more")
    if getattr(args, "git_head", None):  # what common.provenance records for an export
        os.environ["AMEM_COMMIT"] = args.git_head
    if args.command == "run":
        return run_rank(args)
    if args.command == "pairs":
        return orchestrate(args)
    lines = open(args.log, errors="replace").read().splitlines() if args.log else []
    print(json.dumps(merge_run(args.prefix, lines), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
