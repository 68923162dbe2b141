"""The rollout-gain experiment's model presets and their plan: what one run costs in
memory on one H200 shared by two ranks, what the KV cache holds at launch and once
grown into the freed NCCL memory, how long a rollout takes (docs/megatron.md,
"Growing the KV cache"; the experiment: experiments/rollout_gain.py).

Two presets run, the issue's old shape and a realistic one:

- ``tiny_kv``: the first experiment's model, unchanged: 8 layers of 224 heads x 256
  channels on a 256-wide model (1.75 MiB of KV per token), 64-token sequences,
  learned positions, a 32k vocabulary, 64 prompts x 8.
- ``qwen3_1_7b``: Qwen3-1.7B's proportions (28 layers, hidden 2048, 16 heads, 8 KV
  heads of 128, FFN 6144 SwiGLU, RMSNorm 1e-6, rotary base 1e6, tied embeddings, a
  151,936-token vocabulary; 1.72 B parameters), generations of 513 tokens.

``qwen2_5_1_5b`` (28 layers, hidden 1536, 12 heads, 2 KV heads of 128, FFN 8960, QKV
bias) is kept for its plan: its KV is 28 KiB a token, a quarter of Qwen3-1.7B's, so the
same 10.5 GiB cache holds 720 generations at once a rank; to be KV-bound a step needs
1856 requests, and trains on 4x the tokens (``python3 experiments/rollout_gain.py plan
--preset qwen2_5_1_5b``: 114 s rollouts, 131 s of training an iteration): no
run of it fits a 30-minute device budget. Qwen3-1.7B is as common a GRPO base model
(the current one), with 8 KV heads.

The arithmetic (``plan``; every figure it prints comes from the functions below):

- KV bytes a token = 2 (K and V) x layers x KV heads x head size x 2 bytes (bf16),
  the block = block tokens x that (0.19.2's ``DynamicInferenceContext``), the block
  count = floor(buffer / block), ``max_requests`` = (blocks - 1) rounded down to 4.
- Weights, gradients and optimizer state a rank: parameters x (2 + 4 + 12 / DP)
  bytes: bf16 weights, fp32 main gradients (``main_grads_dtype=torch.float32`` in the
  recorded runs' logs), fp32 master weights and Adam's two moments sharded by the
  distributed optimizer; Megatron's own ``theoretical_memory_usage`` formula (it
  printed 5505.80 MB for tiny_kv, as here).
- NCCL: 4.9 GiB a rank in all (``nccl_total_bytes`` of the recorded tiny_kv runs),
  of which the rollout suspends 4.5 GiB (4 communicators of 1152 MiB a rank, 2 ranks
  on one H200, NCCL 2.30.7: FIELD-NOTES section 8).
- The growth: the package's own rule (``kv_cache.Launch.grown_by``: each extra block
  pays for one more request's logits and bookkeeping) over the freed bytes less the
  0.25 GiB margin.
- Training activations: Korthikanti et al.'s s x b x h x (34 + 5 a s / h) bytes a
  layer (no recompute, TP 1, micro-batch 1) plus the logits in bf16 and fp32.
- The flash-attn stand-in (tests/standins/flash_attn) gathers every request's whole
  block table, repeats K and V to the query heads and attends with a mask: per layer
  and step it reads and writes about (3 KV heads + 2 query heads) / KV heads times
  each active request's KV bytes, and holds K and V gathered and repeated at once.
- A rollout: every request generates to ``--inference-max-seq-length`` (a random
  model over a large vocabulary rarely ends early); with one block a request (block
  = the sequence), the engine runs ``max_requests`` at once and queues the rest, so
  without the package it takes ceil(requests / max_requests) waves of generation
  steps. A step costs a fixed part (the engine's Python and launches, 30 ms assumed)
  and the GPU's part for both ranks (bytes over 3 TB/s, FLOPs over 400 TFLOP/s);
  ``serial`` adds the two, ``overlapped`` takes the larger. The serial form gives
  6.4 s for tiny_kv's rollout against 7.1 s measured (its pairs, results/one_h200/
  rollout_gain_megatron_dp2); the overlapped one 3.5 s. With the package the cache
  grows once the suspends are over (0.7 s a GiB, FIELD-NOTES section 8) plus a
  regrow (1 s assumed).

What qwen3_1_7b's plan says (``plan --preset qwen3_1_7b``): 112 KiB of KV a token,
59.5 MiB a block of 544 tokens (one block a request: prompt and generation); a 10.5 GiB
cache holds 180 blocks, 176 requests at once; 4.25 GiB of the 4.5 GiB freed grow it to
251 blocks, 248 requests (capacity x1.40, the freed memory 43 % of the cache); 58
prompts x 8 = 464 requests, 232 a rank, of 513 tokens each, so without the package a
rollout runs 176 then 56 at once (two waves) and with it all 232 once grown; 44 s
(overlapped) to 70 s (serial) a rollout without the package, 160 s of training an
iteration (232 micro-batches of 1 a rank, three passes each at the measured 0.215 s), a
run of 2 iterations 8-9 minutes (measured: about 10, start-up 115 s). Weights, gradients
and optimizer 19.2 GiB a rank; 38.8 GiB a rank in all before torch's cache and
fragmentation, which calibration measures (the recorded tiny_kv runs needed 1.26 x the
same estimate; Qwen3's first iteration reserved 25.7 GB before the KV cache). The two
step models bracket the tokens/s gain: x1.26 serial, x1.12 overlapped, against the goal
x1.20; the curve measures which.

``--sequences-per-bin N`` (``Preset.packed``) trains in Megatron's sequence-packing bins of
N sequences: the training term counts N times fewer passes, each assumed to cost what
one sequence's did (unmeasured), and a bin's activations; the rollout is unchanged.

What is scaled, and why: nothing of the model's shape. The KV cache (10.5 GiB of a
rank's 69.9 GiB share) is held down by a stand-in allocation so that the freed NCCL
memory is 15-50 % of it, as in a job whose model and optimizer fill the GPU (here two
ranks share one H200, and a 1.7 B model leaves most of it free); the sequence is 544
tokens (512-token generations are the issue's minimum; real jobs run 1-8k and more);
QK-norm is left out (the test's THD attention spec has none; it changes neither
memory nor KV); weights are random and the tokenizer one character a token, padded to
the vocabulary; 58 prompts x 8 a step; the block is the whole sequence (Megatron's
default is 256 tokens, a multiple flash-attn needs; the stand-in needs none), so the
engine runs ``max_requests`` at once with no pause or eviction and the KV limit is
plain in the figures.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from types import SimpleNamespace
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from amem_callbacks.adapters.megatron.sizing import (  # noqa: E402
    DEFAULT_KV_MARGIN_GB, Launch, Size, bytes_per_request, requests_for)

GiB, MiB = 2**30, 2**20
#: what torch.cuda.mem_get_info() gave as the H200's total (the recorded runs'
#: ``gpu_total_bytes``; nvidia-smi says 143,771 MiB)
H200_BYTES = 150_109_880_320
#: the recorded tiny_kv runs' ``nccl_total_bytes`` a rank (every communicator, active or not)
NCCL_TOTAL_BYTES = 5_255_462_912
#: what a rollout's begin suspends a rank: 4 communicators of 1152 MiB (FIELD-NOTES section 8)
FREED_BYTES = 4 * 1152 * MiB
CUDA_CONTEXT = int(0.6 * GiB)  # a CUDA context on an H200 with torch 2.11 (not in torch's figures)
SUSPEND_S_PER_GIB = 0.7  # warm (FIELD-NOTES section 8); a freshly started host's first: 16.4 s
#: megatron-core 0.19.2's DynamicInferenceContext: REQUEST_ROUNDER, DEFAULT_MAX_TOKENS
REQUEST_ROUNDER, MAX_TOKENS = 4, 16384
#: the test agent's prompts in the chat template, in tokens (one a character), BOS included:
#: "<s>user: Count: 7 8 9\nassistant: " (tests/gpu/megatron_rl_agent.py, megatron_rl_gpu.py)
PROMPT_TOKENS = 31
#: assumptions of the step-time model (stated, not measured; the curve measures)
STEP_OVERHEAD_S, BANDWIDTH, FLOPS, REGROW_S = 0.030, 3.0e12, 4.0e14, 1.0
#: a run's fixed parts, from the recorded tiny_kv runs: process start to the first
#: rollout's first step (its servers start inside it: 23 s), and the end
STARTUP_S, SHUTDOWN_S = 58.0, 10.0
#: one micro-batch's pass (old log-probs, reference log-probs, training) beyond its
#: FLOPs, measured at micro-batch 1: tiny_kv's iteration spent 25 s outside the rollout
#: over 256 x 3 passes; Qwen3-1.7B's about 150 s over 232 x 3 (2026-12-02, one H200 two
#: ranks share, results/one_h200/rollout_gain_qwen3_dp2/attempt_2026-12-02b_calibrate_
#: timeout). Qwen3's FLOPs are ~10 ms of its 215 ms: a pass is bound by the RL loop's
#: Python and kernel launches (micro-batches of 1: COMMON says why).
TINY_KV_PASS_S, QWEN3_PASS_S = 0.033, 0.215
#: what training held beyond the plan's model state and activations: Qwen3-1.7B's first
#: iteration reserved 25.7 GB before the KV cache against 21.6 GiB planned (2026-12-02b)
TRAINING_UNCOUNTED = int(25.7e9) - int(21.6 * GiB)


@dataclasses.dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = True
    qkv_bias: bool = False
    learned_positions: int = 0  # table length, 0 for rotary

    @property
    def params(self) -> int:
        """Megatron's GPTModel with SwiGLU and RMSNorm (TP 1)."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        layer = (self.hidden * qkv + (qkv if self.qkv_bias else 0)
                 + self.heads * self.head_dim * self.hidden
                 + 3 * self.hidden * self.ffn + 2 * self.hidden)
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * layer + embeddings + self.learned_positions * self.hidden + \
            self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    source: str
    model: Model
    flags: tuple  # train_rl.py's, on top of megatron_rl_gpu.py's TINY defaults
    seq: int  # --inference-max-seq-length: prompt + generation
    block_tokens: int
    prompts: int
    group: int
    buffer_gb: float
    leave_gb: float  # until calibrated (calibrate writes the measured one)
    iters: int
    timeout_s: float
    pass_s: float  # one micro-batch's pass beyond its FLOPs (TINY_KV_PASS_S, QWEN3_PASS_S)
    scaled: str = ""
    #: sequences a training micro-batch: above 1, Megatron's own sequence packing
    #: (``--rl-use-sequence-packing``) in bins of that many sequences (``packed``)
    per_bin: int = 1
    #: Megatron's --empty-unused-memory-level (0: torch keeps training's freed blocks
    #: cached through the rollout, and frees them for an allocation that fails, so a
    #: bigger cache can take them; 2: emptied after every training step)
    empty_level: int = 0

    @property
    def requests(self) -> int:
        return self.prompts * self.group

    @property
    def bin_tokens(self) -> int:
        """A training micro-batch's tokens (``--seq-length``)."""
        return self.seq * self.per_bin

    def packed(self, per_bin: int) -> "Preset":
        """This preset trained in bins of ``per_bin`` sequences (Megatron's sequence
        packing: fewer, longer passes, the same tokens); the rollout is unchanged
        (``--inference-max-seq-length`` stays the sequence). The agent ends each capped
        generation with eod, which packing requires (tests/gpu/capped_generations.py)."""
        if per_bin < 1:
            raise ValueError(f"--sequences-per-bin must be 1 or more, not {per_bin}")
        if per_bin > 1 and self.model.learned_positions:
            raise ValueError(f"--sequences-per-bin {per_bin}: {self.name} has learned "
                             "positions, whose table is --seq-length long (a longer bin "
                             "changes the model); write --sequences-per-bin 1")
        return dataclasses.replace(self, per_bin=per_bin)

    def emptying(self, level: int) -> "Preset":
        """This preset with Megatron's ``--empty-unused-memory-level level``."""
        if level not in (0, 1, 2):
            raise ValueError(f"--empty-unused-memory-level must be 0, 1 or 2, not {level}")
        return dataclasses.replace(self, empty_level=level)

    def train_rl_flags(self, iters: int, buffer_gb: float) -> list:
        flags = list(self.flags)
        if self.empty_level:
            flags += ["--empty-unused-memory-level", str(self.empty_level)]
        if self.per_bin > 1:
            for name in ("--seq-length", "--max-position-embeddings"):
                flags[flags.index(name) + 1] = str(self.bin_tokens)
            flags += ["--rl-use-sequence-packing",
                      "--rl-sequence-packing-max-sequences-per-bin", str(self.per_bin)]
        return flags + ["--train-iters", str(iters),
                        "--inference-dynamic-batching-buffer-size-gb", f"{buffer_gb:g}"]

    def wrapper_flags(self, leave_gb: Optional[float] = None, stop_after: int = 0) -> list:
        out = ["--amem-vocab", str(self.model.vocab), "--amem-memory-trace", "0.05"]
        if leave_gb is not None:
            out += ["--amem-leave-gb", f"{leave_gb:g}"]
        if stop_after:
            out += ["--amem-stop-after-rollouts", str(stop_after)]
        return out


# Micro-batches of 1: without sequence packing Megatron-LM's get_logprobs (and
# train_rl.py's forward_step) pass THD parameters for ONE sequence of the micro-batch's
# length whatever its size (megatron/rl/rl_utils.py, "a single-sequence default"), so 4
# failed in megatron-core 0.19.2's rotary THD path on the GPU (2026-12-02c: "Sizes of
# tensors must match", results/one_h200/rollout_gain_qwen3_dp2/attempt_2026-12-02c_
# micro_batch_4). Several sequences a pass is what Megatron's packing is for
# (``Preset.packed``, ``--sequences-per-bin``).
COMMON = ("--micro-batch-size 1 --use-distributed-optimizer --overlap-grad-reduce "
          "--overlap-param-gather").split()


def _rotary(model: Model, seq: int, block: int, prompts: int, group: int) -> tuple:
    flags = [f"--num-layers {model.layers}", f"--hidden-size {model.hidden}",
             f"--ffn-hidden-size {model.ffn}", f"--num-attention-heads {model.heads}",
             f"--group-query-attention --num-query-groups {model.kv_heads}",
             f"--kv-channels {model.head_dim}", f"--seq-length {seq}",
             f"--max-position-embeddings {seq}", f"--inference-max-seq-length {seq}",
             f"--inference-dynamic-batching-block-size {block}",
             "--position-embedding-type rope --rotary-base 1000000",
             "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear",
             "--make-vocab-size-divisible-by 128",
             f"--grpo-prompts-per-step {prompts} --grpo-group-size {group}",
             f"--global-batch-size {prompts * group}"]
    if model.qkv_bias:
        flags.append("--add-qkv-bias")
    if not model.tied:
        flags.append("--untie-embeddings-and-output-weights")
    return tuple(" ".join(flags).split()) + tuple(COMMON)


TINY_KV = Model(layers=8, hidden=256, heads=224, kv_heads=224, head_dim=256, ffn=512,
                vocab=32000, learned_positions=64)
QWEN3_1_7B = Model(layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128, ffn=6144,
                   vocab=151936)
QWEN2_5_1_5B = Model(layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=8960,
                     vocab=151936, qkv_bias=True)

PRESETS = {
    "tiny_kv": Preset(
        "tiny_kv", "the first experiment's KV-heavy model, unchanged", TINY_KV,
        # The rollout: P x G requests, 64-token sequences in 32-token blocks (two a
        # request), one rollout per iteration.
        tuple(("--num-layers 8 --hidden-size 256 --num-attention-heads 224 --kv-channels 256 "
               "--ffn-hidden-size 512 --seq-length 64 --max-position-embeddings 64 "
               "--position-embedding-type learned_absolute "
               "--inference-max-seq-length 64 --inference-dynamic-batching-block-size 32 "
               "--grpo-prompts-per-step 64 --grpo-group-size 8 --global-batch-size 512 "
               "--micro-batch-size 1 --use-distributed-optimizer --overlap-grad-reduce "
               "--overlap-param-gather").split()),
        seq=64, block_tokens=32, prompts=64, group=8, buffer_gb=10.0, leave_gb=30.0, iters=2,
        timeout_s=150.0, pass_s=TINY_KV_PASS_S,
        scaled="a KV-heavy toy: 224 heads x 256 channels on a 256-wide model, learned "
        "positions (rotary needs heads x channels = hidden)"),
    "qwen3_1_7b": Preset(
        "qwen3_1_7b", "Qwen3-1.7B's config.json (Qwen/Qwen3-1.7B)", QWEN3_1_7B,
        _rotary(QWEN3_1_7B, 544, 544, 58, 8), seq=544, block_tokens=544, prompts=58, group=8,
        # timeout: measured 2026-12-02 on one H200, start-up ~115 s and an iteration ~236 s
        # (results/one_h200/rollout_gain_qwen3_dp2/attempt_2026-12-02b_calibrate_timeout)
        buffer_gb=10.5, leave_gb=50.0, iters=2, timeout_s=900.0, pass_s=QWEN3_PASS_S,
        scaled="the KV cache held to 10.5 GiB (freed NCCL memory 15-50 % of it), 544-token "
        "sequences, no QK-norm (the THD spec stand-in has none), random weights, a "
        "character tokenizer padded to the vocabulary, 58 prompts x 8"),
    "qwen2_5_1_5b": Preset(
        "qwen2_5_1_5b", "Qwen2.5-1.5B's config.json (Qwen/Qwen2.5-1.5B)", QWEN2_5_1_5B,
        _rotary(QWEN2_5_1_5B, 544, 544, 232, 8), seq=544, block_tokens=544, prompts=232,
        group=8, buffer_gb=10.5, leave_gb=50.0, iters=2, timeout_s=900.0, pass_s=QWEN3_PASS_S,
        scaled="as qwen3_1_7b; its 2 KV heads need ~4x the requests for the same cache"),
}


# --- the KV cache ---------------------------------------------------------------------
class _Context:
    """What the package's growth arithmetic reads of a 0.19.2 context."""

    REQUEST_ROUNDER = REQUEST_ROUNDER

    def __init__(self, preset: Preset):
        self.max_tokens = MAX_TOKENS
        self.num_speculative_tokens = 0
        self.max_kv_block_count = math.ceil(preset.seq / preset.block_tokens)


def block_bytes(preset: Preset) -> int:
    return preset.model.kv_bytes_per_token * preset.block_tokens


def launch(preset: Preset, buffer_gb: float) -> Launch:
    """The engine as 0.19.2 sizes it from ``--inference-dynamic-batching-buffer-size-gb``."""
    context = _Context(preset)
    blocks = max(2, int(buffer_gb * GiB) // block_bytes(preset))
    engine = SimpleNamespace(context=context, controller=SimpleNamespace(
        vocab_size=padded_vocab(preset.model.vocab),
        inference_wrapped_model=SimpleNamespace(config=SimpleNamespace(
            params_dtype=SimpleNamespace(itemsize=2)))))
    return Launch(Size(blocks, requests_for(context, blocks, 1)),
                  block_bytes(preset), preset.block_tokens,
                  bytes_per_request(engine), 1, None)


def padded_vocab(vocab: int, multiple: int = 128) -> int:
    return -(-vocab // multiple) * multiple


def full_length_slots(preset: Preset, size: Size) -> int:
    """Requests that fit at once at their full length (blocks, and max_requests)."""
    per_request = math.ceil(preset.seq / preset.block_tokens)
    return min(size.max_requests, (size.blocks - 1) // per_request)


# --- memory a rank ------------------------------------------------------------------
def model_state_bytes(model: Model, dp: int) -> int:
    return int(model.params * (2 + 4 + 12 / dp))


def training_activation_bytes(preset: Preset) -> int:
    """A micro-batch's (a bin of ``per_bin`` sequences: the THD attention stand-in
    attends each sequence on its own, so the score term is a sequence's)."""
    m, s, b = preset.model, preset.seq, preset.bin_tokens
    per_layer = b * m.hidden * (34 + 5 * m.heads * s / m.hidden)
    logits = b * padded_vocab(m.vocab) * (2 + 4 + 4)  # bf16 logits, fp32 log-softmax, its grad
    return int(m.layers * per_layer + logits)


def standin_attention_bytes(preset: Preset, requests: int) -> int:
    """One layer's K and V gathered and repeated to the query heads, every request at
    once (freed after the layer), plus the step's logits."""
    m = preset.model
    gathered = _Context(preset).max_kv_block_count * preset.block_tokens
    heads = 2 * m.kv_heads + (2 * m.heads if m.heads != m.kv_heads else 0)
    return requests * (gathered * m.head_dim * 2 * heads + padded_vocab(m.vocab) * 6)


def standin_traffic_per_request(preset: Preset) -> int:
    """Bytes one active request costs the stand-in per decode step, all layers: the
    gather reads and writes K and V, the repeat reads them and writes them per query
    head, the attention reads them again."""
    m = preset.model
    gathered = _Context(preset).max_kv_block_count * preset.block_tokens
    kv = gathered * m.kv_bytes_per_token
    return int(kv * (3 * m.kv_heads + 2 * m.heads) / m.kv_heads)


# --- a rollout ------------------------------------------------------------------------
def step_seconds(preset: Preset, active: int, ranks: int, *, overlapped: bool,
                 overhead: float = STEP_OVERHEAD_S, bandwidth: float = BANDWIDTH,
                 flops: float = FLOPS) -> float:
    params = preset.model.params
    gpu = ranks * ((active * standin_traffic_per_request(preset) + 2 * params) / bandwidth
                   + 2 * params * active / flops)
    return max(overhead, gpu) if overlapped else overhead + gpu


def simulate(requests: int, tokens: int, slots: int, step, *, grown_slots: int = 0,
             grow_at_s: float = 0.0, regrow_s: float = REGROW_S) -> dict:
    """One rank's rollout, step by step: ``requests`` all asked at once, each to
    generate ``tokens``; ``slots`` run at once (``grown_slots`` from ``grow_at_s``
    on, after a regrow); ``step(active)`` is a step's seconds."""
    waiting, active, t, steps, peak, grown = requests, [], 0.0, 0, 0, False
    while waiting or active:
        room = (grown_slots if grown else slots) - len(active)
        admitted = max(0, min(waiting, room))
        active += [tokens] * admitted
        waiting -= admitted
        peak = max(peak, len(active))
        t += step(len(active))
        steps += 1
        active = [left - 1 for left in active if left > 1]
        if grown_slots and not grown and t >= grow_at_s:
            t += regrow_s
            grown = True
    return {"seconds": t, "steps": steps, "peak_in_flight": peak}


def train_seconds(preset: Preset, ranks: int) -> float:
    """A training iteration outside its rollout: the old and reference log-prob
    passes (a forward each) and the training step, every sample padded to the
    sequence, FLOPs shared by the ranks, plus each micro-batch's pass (a bin's, with
    sequence packing: assumed to cost what one sequence's did, the pass being bound by
    the loop's Python and launches; unmeasured above one sequence)."""
    tokens = preset.requests * preset.seq
    flops = (2 + 2 + 6) * preset.model.params * tokens
    bins = math.ceil(math.ceil(preset.requests / ranks) / preset.per_bin)
    return flops / FLOPS + 3 * bins * preset.pass_s


def plan(preset: Preset, *, buffer_gb: Optional[float] = None, ranks: int = 2,
         gpu_bytes: int = H200_BYTES, freed_bytes: int = FREED_BYTES,
         nccl_total_bytes: int = NCCL_TOTAL_BYTES,
         margin_bytes: int = int(DEFAULT_KV_MARGIN_GB * GiB)) -> dict:
    """Every figure of the arithmetic in the module docstring, for ``preset``."""
    buffer_gb = preset.buffer_gb if buffer_gb is None else buffer_gb
    m = preset.model
    at_launch = launch(preset, buffer_gb)
    grown = at_launch.grown_by(_Context(preset), freed_bytes - margin_bytes)
    slots, grown_slots = (full_length_slots(preset, at_launch.size),
                          full_length_slots(preset, grown))
    per_rank = preset.requests // ranks
    tokens = preset.seq - PROMPT_TOKENS
    kv_bytes = at_launch.bytes_of(at_launch.size)
    capacity = (at_launch.size.blocks - 1) * preset.block_tokens
    grown_capacity = (grown.blocks - 1) * preset.block_tokens
    transient = standin_attention_bytes(preset, at_launch.size.max_requests)
    transient_grown = standin_attention_bytes(preset, grown.max_requests)
    memory = {"model_state": model_state_bytes(m, ranks), "nccl": nccl_total_bytes,
              "cuda_context": CUDA_CONTEXT, "training_activations": training_activation_bytes(
                  preset), "kv_cache": kv_bytes, "standin_attention": transient}
    need = sum(memory.values())
    rollout = {}
    for name in ("serial", "overlapped"):
        step = lambda active, name=name: step_seconds(preset, active, ranks,  # noqa: E731
                                                      overlapped=name == "overlapped")
        without = simulate(per_rank, tokens, slots, step)
        with_ = simulate(per_rank, tokens, slots, step, grown_slots=grown_slots,
                         grow_at_s=freed_bytes / GiB * SUSPEND_S_PER_GIB)
        rollout[name] = {"without_s": without["seconds"], "with_s": with_["seconds"],
                         "tokens_per_s_ratio": without["seconds"] / with_["seconds"],
                         "peak_in_flight": [without["peak_in_flight"], with_["peak_in_flight"]],
                         "step_s_at_launch": step(slots)}
    capacity_ratio = grown_capacity / capacity
    train_s = train_seconds(preset, ranks)
    for r in rollout.values():  # a run: start, rollouts and training steps, the end
        r["run_s"] = [STARTUP_S + preset.iters * (seconds + train_s) + SHUTDOWN_S
                      for seconds in (r["without_s"], r["with_s"])]
    out = {
        "preset": preset.name, "source": preset.source, "scaled": preset.scaled,
        "iters": preset.iters,
        "params": m.params, "kv_bytes_per_token": m.kv_bytes_per_token,
        "block_tokens": preset.block_tokens, "block_bytes": at_launch.block_bytes,
        "request_bytes": at_launch.request_bytes, "buffer_gb": buffer_gb,
        "launch": {"blocks": at_launch.size.blocks, "max_requests": at_launch.size.max_requests,
                   "token_capacity": capacity, "full_length_requests": slots,
                   "kv_bytes": kv_bytes},
        "grown": {"blocks": grown.blocks, "max_requests": grown.max_requests,
                  "token_capacity": grown_capacity, "full_length_requests": grown_slots,
                  "kv_bytes": at_launch.bytes_of(grown)},
        "freed_bytes": freed_bytes, "margin_bytes": margin_bytes,
        "freed_fraction_of_kv": freed_bytes / kv_bytes, "capacity_ratio": capacity_ratio,
        "requests": preset.requests, "requests_per_rank": per_rank,
        "generated_tokens_per_request": tokens,
        "waves": [math.ceil(per_rank / slots), math.ceil(per_rank / grown_slots)],
        "memory_per_rank": memory, "need_per_rank": need, "share_per_rank": gpu_bytes // ranks,
        "standin_attention_growth": transient_grown - transient,
        "slack_gb": round((transient_grown - transient) / GiB + 0.75, 2),
        "rollout": rollout, "train_s": train_s, "sequences_per_bin": preset.per_bin,
        "bins_per_rank": math.ceil(per_rank / preset.per_bin),
        "goals": {"tokens_per_s_ratio": 1 + 0.5 * (capacity_ratio - 1),
                  "concurrency_ratio": 0.9 * capacity_ratio},
    }
    out["checks"] = {
        "generations of at least 512 tokens": tokens >= 512,
        "freed NCCL memory is 15-50 % of the KV cache": 0.15 <= out["freed_fraction_of_kv"] <= 0.5,
        "KV-bound without the package (more requests than fit at once)": per_rank > slots,
        "the grown cache runs at least 90 % of what its capacity could":
            min(per_rank, grown_slots) >= 0.9 * capacity_ratio * slots,
        "a rollout lasts at least 30 s without the package":
            rollout["overlapped"]["without_s"] >= 30,
        "the run fits a rank's share of the GPU": need < out["share_per_rank"],
        # calibrate's need is then the rollout's peak, so the control's bigger cache
        # cannot fit (with sequence packing a bin's activations grow with it)
        "training's peak stays under the rollout's":
            memory["training_activations"] + TRAINING_UNCOUNTED < kv_bytes + transient,
    }
    return out


def lines(p: dict) -> list:
    """``plan``'s figures as the arithmetic reads."""
    g = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
    launch_, grown = p["launch"], p["grown"]
    out = [f"{p['preset']} ({p['source']}): {p['params'] / 1e9:.3f} B parameters",
           f"KV: 2 x layers x KV heads x head size x 2 bytes = {p['kv_bytes_per_token']} bytes "
           f"({p['kv_bytes_per_token'] / 1024:g} KiB) a token; a block of {p['block_tokens']} "
           f"tokens = {p['block_bytes'] / MiB:.1f} MiB",
           f"launch: {p['buffer_gb']:g} GiB -> {launch_['blocks']} blocks, max_requests "
           f"{launch_['max_requests']}, {launch_['token_capacity']} tokens, "
           f"{launch_['full_length_requests']} full-length requests at once",
           f"grown: {g(p['freed_bytes'])} freed - {g(p['margin_bytes'])} margin, "
           f"{p['request_bytes']} bytes a request beyond its blocks -> {grown['blocks']} "
           f"blocks, max_requests {grown['max_requests']}, {grown['full_length_requests']} "
           f"full-length at once: capacity x{p['capacity_ratio']:.3f}; freed = "
           f"{100 * p['freed_fraction_of_kv']:.0f} % of the cache",
           f"requests: {p['requests']} ({p['requests_per_rank']} a rank), "
           f"{p['generated_tokens_per_request']} generated tokens each; waves without/with: "
           f"{p['waves'][0]}/{p['waves'][1]}",
           "memory a rank: " + ", ".join(f"{k} {g(v)}" for k, v in p["memory_per_rank"].items())
           + f"; total {g(p['need_per_rank'])} of a {g(p['share_per_rank'])} share "
           f"(before torch's cache; calibrate); slack {p['slack_gb']} GiB (the stand-in's "
           f"attention at the grown max_requests + 0.75)"]
    for name, r in p["rollout"].items():
        out.append(f"rollout ({name} step model): {r['without_s']:.1f} s without, "
                   f"{r['with_s']:.1f} s with (tokens/s x{r['tokens_per_s_ratio']:.2f}; a "
                   f"step at the launch size {1000 * r['step_s_at_launch']:.0f} ms); a run of "
                   f"{p['iters']} iterations {r['run_s'][0]:.0f} s / {r['run_s'][1]:.0f} s")
    out.append(f"training outside the rollout: {p['train_s']:.1f} s an iteration "
               f"({p['bins_per_rank']} micro-batches of {p['sequences_per_bin']} "
               f"sequence{'s' if p['sequences_per_bin'] > 1 else ''} a rank)")
    out.append(f"goals: tokens/s x{p['goals']['tokens_per_s_ratio']:.3f}, concurrency "
               f"x{p['goals']['concurrency_ratio']:.3f}")
    out += [f"{'ok  ' if ok else 'FAIL'} {what}" for what, ok in p["checks"].items()]
    if p["scaled"]:
        out.append(f"scaled: {p['scaled']}")
    return out
