"""GRPO with ``AMemCallback``: idle NCCL memory is freed while the model generates.

On a CPU, as a demo (a tiny model and tokenizer built here, nothing downloaded):

    python examples/trl_grpo.py
    torchrun --nproc-per-node 2 examples/trl_grpo.py --backend noop   # dry run over gloo

On GPUs, for real (NCCL >= 2.29.7 loaded by torch):

    torchrun --nproc-per-node 2 examples/trl_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 20

The only line that concerns amem_callbacks is ``callbacks=[AMemCallback(...)]``;
its figures land in the trainer's logs as ``amem/...``.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import tempfile

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from amem_callbacks.adapters.trl import AMemCallback

WORDS = [f"w{i}" for i in range(64)]


def tiny_model_and_tokenizer():
    """A randomly initialised 2-layer Qwen2 and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = ["<pad>", "<eos>", "<unk>"] + WORDS
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                         bos_token_id=None, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config), tokenizer


def prompts(tiny: bool) -> Dataset:
    if tiny:
        texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(4)) for i in range(256)]
    else:
        texts = [f"Write {n} words about the number {n * 7}:" for n in range(1, 257)]
    return Dataset.from_dict({"prompt": texts})


def reward(completions, **kwargs):
    """Prefers completions of about eight words."""
    return [-abs(len(c.split()) - 8) / 8.0 for c in completions]


def build_parser() -> argparse.ArgumentParser:
    # The callback's own default, read from it: the example must not run
    # differently from a plain AMemCallback() (it once defaulted to False).
    overlap = inspect.signature(AMemCallback).parameters["overlap"].default
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model",
                        help="a causal LM on the Hub or on disk (default: a tiny one built here)")
    parser.add_argument("--backend", default="auto", help="auto, nccl, amem or noop (dry run)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=overlap,
                        help="suspend and resume in the background while the model generates "
                             f"(AMemCallback's default: {'on' if overlap else 'off'}); "
                             "--no-overlap waits for each transition")
    parser.add_argument("--output-dir", default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.WARNING)

    if args.model:
        model, tokenizer = args.model, None
    else:
        model, tokenizer = tiny_model_and_tokenizer()
    config = GRPOConfig(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="amem-grpo-"),
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
        per_device_train_batch_size=4, num_generations=4, max_steps=args.steps,
        max_completion_length=args.completion_length, logging_steps=1, report_to=[],
        save_strategy="no", seed=0, disable_tqdm=True)
    callback = AMemCallback(backend=args.backend, overlap=args.overlap)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=prompts(tiny=not args.model), processing_class=tokenizer,
                          callbacks=[callback])
    trainer.train()

    if trainer.is_world_process_zero():
        begin, inert = callback.last_begin, callback.metrics().get("amem/inert")
        backend = (begin.backend if begin else "none: training ran unchanged" if inert
                   else "none: torch.distributed not initialised")
        print(f"\nbackend: {backend}")
        if callback.kept:
            print(f"kept active during generation: {callback.kept}")
        for report in (callback.last_begin, callback.last_end):
            if report is not None:
                print(report.summary())
        logged = [log for log in trainer.state.log_history if "amem/total/begins" in log]
        if logged:
            last = logged[-1]
            print("last log:", {k: v for k, v in last.items() if k.startswith("amem/total/")})


if __name__ == "__main__":
    main()
