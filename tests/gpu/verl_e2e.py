"""verl 0.9.1 end to end (issue 62): a GRPO job with real Ray and verl's own vLLM rollout
servers on one GPU, with and without ``+actor_rollout_ref.rollout.custom.amem.enable=true``.

    python3 tests/gpu/verl_e2e.py fixture DIR           # model, tokenizer, data, reward (CPU ok)
    python3 tests/gpu/verl_e2e.py check DIR [--amem]    # the job's config, composed and checked
    python3 tests/gpu/verl_e2e.py run OUT NAME --fixture DIR [--amem] [--share U] [--steps N]
                                      [--kv-gib G] [--ballast-gib B]

The job (the overrides below, each for a reason read from verl 0.9.1's sources): a Qwen2
of 2 layers built in code (no hub download), GRPO, 2 FSDP2 training ranks and one vLLM
replica of tensor-parallel 1 per rank (hybrid: colocated on the ranks' GPU), a reward
function in a file, console and JSONL metrics (verl's "file" logger: every step's
figures, the ``amem/*`` ones included, as verl's tracking received them).

Several ranks on one GPU is a test configuration, here only: Ray is told the node has
two GPUs (``ray_init.num_gpus=2``) and every Ray worker starts with
CUDA_VISIBLE_DEVICES=0 (its runtime env), so both ranks and both vLLM servers use card 0
(Ray maps a slot past the visible ids back to them; checked with Ray 2.60 on CPU). NCCL
>= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 lets the two ranks share a communicator there.
The launching shell must not set CUDA_VISIBLE_DEVICES (Ray refuses 2 GPUs beside one
visible id).

``--kv-gib`` sizes each engine's KV cache (``kv_cache_memory_bytes``); ``--ballast-gib``
holds that much of the card in a process of its own for the job's length, so that the
card is as full as a real job's (the fixture's model leaves it nearly empty): the KV
size that still starts and runs is then the yardstick, with and without the package
(issue 59's method; the package's suspend before the servers' launch is what lets a
larger one start).

Out, per run: OUT/NAME/{metrics.jsonl, log.txt, record.json} (record: rc, seconds, the
command, commit, machine, per-step figures, whether it ran out of memory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


#: vLLM sizes each engine's KV cache from this many bytes instead of profiling: the two
#: engines start at once on one card, and vLLM's profiler fails when the other's
#: allocations move the free memory under it (vllm v1 gpu_worker's memory check)
KV_BYTES = 2 << 30
PROMPTS = 256
#: every Ray worker's environment beyond verl's own (strings: Ray takes no other type)
WORKER_ENV = {
    # two ranks of one communicator on one card (NCCL >= 2.30)
    "NCCL_MULTI_RANK_GPU_ENABLE": "1",
    # vLLM 0.24's sampler imports flashinfer unless this is 0; flashinfer does not travel
    # (tests/gpu/bundle_verl_e2e.sh): PyTorch's sampler instead, with or without the package
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}


def make_fixture(folder: str) -> dict:
    """A tokenizer trained in code, a 2-layer Qwen2 saved in bf16, train/val parquet of
    toy additions and the reward file. Deterministic; a few MB."""
    import pandas as pd
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = [str(i) for i in range(100)] + "what is plus the answer add equals and".split()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([" ".join(words)] * 10, trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = (  # verl applies the chat template to every prompt
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model_dir = os.path.join(folder, "model")
    os.makedirs(model_dir, exist_ok=True)
    hf.save_pretrained(model_dir)
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
    rows = [{"data_source": "toy_add", "ability": "math",
             "prompt": [{"role": "user", "content": f"what is {i % 10} plus {i * 7 % 10}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i % 10 + i * 7 % 10)},
             "extra_info": {"index": i}} for i in range(PROMPTS)]
    pd.DataFrame(rows).to_parquet(os.path.join(folder, "train.parquet"))
    pd.DataFrame(rows[:16]).to_parquet(os.path.join(folder, "val.parquet"))
    with open(os.path.join(folder, "reward.py"), "w") as f:
        f.write("def compute_score(data_source, solution_str, ground_truth, extra_info=None, "
                "**kwargs):\n    return 1.0 if ground_truth in solution_str else 0.0\n")
    return {"model": model_dir, "tokens": len(hf)}


def overrides(fixture: str, amem: bool, share: float = 0.15, steps: int = 20,
              kv_bytes: int = KV_BYTES) -> list:
    """The hydra overrides of ``verl.trainer.main_ppo``; each non-default for a reason."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={fixture}/train.parquet", f"data.val_files={fixture}/val.parquet",
        "data.train_batch_size=8", "data.max_prompt_length=64", "data.max_response_length=32",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={fixture}/model",
        # no flash-attn on the image: sdpa, and no padding removal (flash varlen's)
        "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",  # the default is FSDP1
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=4",
        # one replica per rank: the default 2 makes one server of both ranks with
        # CUDA_VISIBLE_DEVICES "0,0"
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={share}",  # per engine, whole card
        "actor_rollout_ref.rollout.max_model_len=96",
        "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "actor_rollout_ref.rollout.enforce_eager=true",  # no compile, no CUDA graphs
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        # a 2 GiB bucket a rank at every hand-off is for real models
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes={kv_bytes}",
        f"reward.custom_reward_function.path={fixture}/reward.py",
        "reward.custom_reward_function.name=compute_score", "reward.num_workers=1",
        "trainer.n_gpus_per_node=2", "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[console,file]",
        # the harness's two ranks on one card (module docstring)
        "+ray_kwargs.ray_init.num_gpus=2",
        "+ray_kwargs.ray_init.runtime_env.env_vars.CUDA_VISIBLE_DEVICES='0'",
    ] + [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in WORKER_ENV.items()
         ] + (["+actor_rollout_ref.rollout.custom.amem.enable=true"] if amem else [])


def compose(overrides_: list):
    """verl's own config of the job, composed and checked as main_ppo does it before any
    worker starts (hydra, validate_config, the rollout and model dataclasses: where the
    adapter's config entry is checked on the driver)."""
    import verl.trainer.main_ppo as main_ppo
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = hydra_compose(config_name="ppo_trainer", overrides=overrides_)
    validate_config(config, use_reference_policy=need_reference_policy(config),
                    use_critic=need_critic(config))
    OmegaConf.resolve(config)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    return config, rollout


def environment(base=None) -> dict:
    """The job's environment: no CUDA_VISIBLE_DEVICES (Ray's runtime env sets it in each
    worker), several ranks on one GPU allowed (inherited by the raylet and its workers)."""
    env = dict(os.environ if base is None else base)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(WORKER_ENV)  # the raylet and its workers inherit it too
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _oom(text: str) -> bool:
    return any(s in text for s in ("CUDA out of memory", "OutOfMemoryError",
                                   "CUDA Error: out of memory", "Free memory on device"))


def steps_of(metrics_path: str) -> list:
    """verl's file logger's rows: [{"step": n, "data": {...}}, ...]."""
    rows = []
    try:
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except OSError:
        pass
    return rows


def record(name: str, amem: bool, share: float, command: list, rc, seconds: float,
           log: str, metrics_path: str) -> dict:
    from amem_callbacks.tools.provenance import machine
    from tests.gpu.common import run_commit

    rows = steps_of(metrics_path)
    pick = lambda key: [r["data"].get(key) for r in rows]  # noqa: E731
    amem_keys = sorted({k for r in rows for k in r["data"] if k.startswith("amem/")})
    return {"name": name, "amem": amem, "share": share, "rc": rc, "seconds": seconds,
            "ok": rc == 0 and bool(rows), "oom": _oom(log), "command": " ".join(command),
            # read after the job: the driver holds no CUDA context while it runs
            "commit": run_commit(), "machine": machine(), "steps": len(rows),
            "step_s": pick("timing_s/step"), "gen_s": pick("timing_s/gen"),
            "pg_loss": pick("actor/pg_loss"), "amem_keys": amem_keys,
            "amem_last": {k: rows[-1]["data"][k] for k in amem_keys} if rows else {},
            "amem_begins": pick("amem/total/begins"),
            "first_seen_s": first_seen(log),
            "tail": log[-3000:]}


def copy_stamped(stream, log, began: float) -> None:
    """The job's output into ``log``, each line behind the seconds since ``began``: the
    first run on a GPU spent ~160 s before its first rollout server, and said nowhere
    on what (Ray's lines carry no time)."""
    for raw in iter(stream.readline, b""):
        log.write(f"[{time.monotonic() - began:7.1f} s] {raw.decode(errors='replace')}")
        log.flush()


#: a line of one of Ray's processes, as Ray prefixes it: "(WorkerDict pid=2621) ..."
RAY_PROCESS = re.compile(r"^\[ *([0-9.]+) s\] (?:\x1b\[[0-9;]*m)?\((\w+) pid=(\d+)")


def first_seen(log: str) -> dict:
    """Seconds into the job at which each of Ray's processes first wrote a line, by
    "name pid" (the task runner, every training worker, every rollout server)."""
    seen = {}
    for line in log.splitlines():
        m = RAY_PROCESS.match(line)
        if m:
            seen.setdefault(f"{m.group(2)} {m.group(3)}", float(m.group(1)))
    return seen


#: the ballast: a process that holds N bytes of card 0 until it is killed
BALLAST = ("import sys, time, torch\n"
           "held = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda:0')\n"
           "print('held', held.numel(), flush=True)\n"
           "time.sleep(1e9)\n")


def hold_ballast(gib: float, timeout_s: float = 120):
    """Start the ballast and return it once it holds ``gib`` GiB (None for 0); raises
    RuntimeError with its output when it could not."""
    if gib <= 0:
        return None
    proc = subprocess.Popen([sys.executable, "-c", BALLAST, str(int(gib * 2**30))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list = []  # its first line, read on a thread: a hung start must not hang us
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not (lines and lines[0].startswith(b"held")):
        proc.kill()
        rest = proc.communicate(timeout=30)[0] or b""
        raise RuntimeError(f"the ballast of {gib} GiB did not hold: "
                           f"{(b''.join(lines) + rest).decode(errors='replace')[-500:]}")
    return proc


class PeakUsed(threading.Thread):
    """Card 0's used memory, polled through nvidia-smi once a second (the driver holds no
    CUDA context): the most seen, MiB, or None without nvidia-smi. What a ballast for a
    fuller card is chosen from."""

    QUERY = ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits",
             "-i", "0"]

    def __init__(self, every_s: float = 1.0):
        super().__init__(daemon=True)
        self.every_s, self.peak_mib, self.total_mib = every_s, None, None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                used, total = subprocess.run(self.QUERY, capture_output=True, text=True,
                                             timeout=10).stdout.split(",")[:2]
                self.peak_mib = max(self.peak_mib or 0, int(used))
                self.total_mib = int(total)
            except (OSError, ValueError, subprocess.SubprocessError):
                return  # no nvidia-smi (the CPU) or an answer not read: nothing more to see
            self.done.wait(self.every_s)

    def stop(self) -> dict:
        self.done.set()
        self.join(15)
        return {"peak_used_mib": self.peak_mib, "total_mib": self.total_mib}


def run(out: str, name: str, fixture: str, amem: bool, share: float, steps: int,
        timeout_s: float, kv_gib: float = KV_BYTES / 2**30, ballast_gib: float = 0.0) -> dict:
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    metrics = os.path.join(folder, "metrics.jsonl")
    command = [sys.executable, "-m", "verl.trainer.main_ppo",
               *overrides(fixture, amem, share, steps, kv_bytes=int(kv_gib * 2**30)),
               f"trainer.experiment_name={name}", "trainer.project_name=amem_e2e"]
    env = dict(environment(), VERL_FILE_LOGGER_PATH=metrics)
    ballast = hold_ballast(ballast_gib)
    peak = PeakUsed()
    peak.start()
    began = time.monotonic()
    with open(os.path.join(folder, "log.txt"), "w") as log:
        proc = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        copier = threading.Thread(target=copy_stamped, args=(proc.stdout, log, began),
                                  daemon=True)
        copier.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # Ray's workers live in the job's session: end them all
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            # the module, not the `ray` script: a bundle installed with --target has no
            # script on PATH
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                           capture_output=True)
            copier.join(timeout=30)
            card = peak.stop()  # the ballast's memory included
            if ballast is not None:
                ballast.kill()
                ballast.wait(30)
    with open(os.path.join(folder, "log.txt"), errors="replace") as f:
        text = f.read()
    result = record(name, amem, share, command, rc, time.monotonic() - began, text, metrics)
    per_token = kv_bytes_per_token(fixture)
    result.update(kv_gib=kv_gib, ballast_gib=ballast_gib,
                  kv_tokens=int(kv_gib * 2**30) // per_token if per_token else None, **card)
    with open(os.path.join(folder, "record.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def kv_bytes_per_token(fixture: str) -> int:
    """A token's K and V over every layer, in the model's dtype (bf16): what vLLM's KV
    cache holds per token for this model (None without the fixture's config)."""
    try:
        with open(os.path.join(fixture, "model", "config.json")) as f:
            c = json.load(f)
    except OSError:
        return None
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2


def _mean_gap(a: list, b: list) -> Optional[float]:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(abs(x - y) for x, y in pairs) / len(pairs) if pairs else None


def verify(out: str, steps: int = 20) -> dict:
    """Issue 62's item 2, read from the records of the runs in ``out`` (record.json of
    each): every check by name, true or false, with the figures it read."""
    runs = {}
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name, "record.json")
        if os.path.isfile(path):
            with open(path) as f:
                runs[name] = json.load(f)
    base = [r for r in runs.values() if not r["amem"] and r["ok"]]
    # what two runs without the package differ by: the losses' yardstick
    twins = [_mean_gap(a["pg_loss"], b["pg_loss"]) for i, a in enumerate(base)
             for b in base[i + 1:]]
    twins = [t for t in twins if t is not None]
    checks, figures = {}, {}
    for name, r in runs.items():
        if not r["amem"]:
            continue
        last = r.get("amem_last", {})
        get = lambda key: last.get(key, 0)  # noqa: E731 (an absent count is none)
        begins = get("amem/total/begins")
        checks[name] = c = {
            "ran_every_step": r["ok"] and r["steps"] >= steps,
            # amem_metrics went through the worker group into verl's Tracking.log
            "amem_figures_in_tracking": bool(r.get("amem_keys")),
            "a_begin_every_step": all(b is not None for b in r.get("amem_begins", [None])),
            # every begin before a KV cache: each wake-up's, and the servers' launch
            "suspended_before_every_kv_wake_up": begins >= steps and get(
                "amem/verl/suspends_before_kv_cache") + get("amem/verl/suspends_before_launch")
            == begins,
            "suspended_before_launch": get("amem/verl/suspends_before_launch") >= 1,
            "groups_suspended": get("amem/total/group_suspends") > 0,
            # amem_rollout_ended, dispatched by the driver after sleep_replicas
            "ended_at_sleep_replicas": get("amem/verl/ends_at_sleep_replicas")
            >= get("amem/total/ends") > 0 and get("amem/verl/ends_at_training_call") == 0,
            "no_guard_resume": get("amem/total/auto_resumes") == 0,
            "no_failure": get("amem/total/failures") == 0,
            # the free memory the KV wake-up found grew by at least this rank's suspend
            "memory_freed_before_kv": get("amem/begin/nccl_bytes") > 0 and max(
                get("amem/begin/gpu_wide_freed_bytes"), get("amem/begin/device_freed_bytes"))
            >= 0.9 * get("amem/begin/nccl_bytes"),
        }
        gaps = [g for g in (_mean_gap(r["pg_loss"], b["pg_loss"]) for b in base) if g is not None]
        figures[name] = {"loss_gap_to_runs_without": gaps, "loss_gap_between_runs_without": twins,
                         "begins": begins, "nccl_bytes": get("amem/begin/nccl_bytes")}
        # within what two runs without the package differ by (needs two of them)
        c["losses_within_runs_without"] = bool(gaps and twins) and max(gaps) <= 2 * max(twins)
    return {"checks": checks, "figures": figures,
            "ok": bool(checks) and all(all(c.values()) for c in checks.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("fixture")
    p.add_argument("folder")
    p = sub.add_parser("check")
    p.add_argument("folder")
    p.add_argument("--amem", action="store_true")
    p = sub.add_parser("verify")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=20)
    p = sub.add_parser("run")
    p.add_argument("out")
    p.add_argument("name")
    p.add_argument("--fixture", required=True)
    p.add_argument("--amem", action="store_true")
    p.add_argument("--share", type=float, default=0.15)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout-s", type=float, default=540)
    p.add_argument("--kv-gib", type=float, default=KV_BYTES / 2**30,
                   help="each engine's KV cache (vLLM's kv_cache_memory_bytes), GiB")
    p.add_argument("--ballast-gib", type=float, default=0.0,
                   help="GiB of the card held by a process of its own for the job's length")
    args = parser.parse_args(argv)
    if args.command == "fixture":
        print(json.dumps(make_fixture(args.folder)))
    elif args.command == "verify":
        result = verify(args.out, args.steps)
        print(json.dumps(result, indent=1))
        return 0 if result["ok"] else 1
    elif args.command == "check":
        config, rollout = compose(overrides(args.folder, args.amem))
        print(json.dumps({"rollout": rollout.name, "tp": rollout.tensor_model_parallel_size,
                          "sleep": rollout.enable_sleep_mode, "custom": dict(rollout.custom or {}),
                          "strategy": config.actor_rollout_ref.actor.strategy}))
    else:
        result = run(args.out, args.name, args.fixture, args.amem, args.share, args.steps,
                     args.timeout_s, args.kv_gib, args.ballast_gib)
        print(json.dumps({k: result[k] for k in ("name", "rc", "ok", "oom", "steps", "seconds",
                                                 "kv_gib", "kv_tokens", "ballast_gib",
                                                 "peak_used_mib", "amem_keys")}))
        return 0 if result["ok"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
