"""GRPO runs on gloo ranks for the TRL adapter, run by tests.harness in fresh processes.

A real ``GRPOTrainer`` on a tiny randomly initialised Qwen2 and a word-level
tokenizer built here (no downloads). vLLM is not installed: the vLLM runs use
trl's own ``VLLMGeneration.generate`` on a stand-in server client (server mode)
or a stand-in ``LLM`` (colocate mode).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist

from amem_callbacks import OffloadPolicy
from amem_callbacks.adapters.trl import AMemCallback

VOCAB = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(45)]
PAD, EOS = 0, 1
COMPLETION_LEN = 4


def init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two ranks share the CI machine's cores
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
                         bos_token_id=None, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 45}" for j in range(3))
                                         for i in range(64)]})


def reward(completions, **kwargs):
    """Varied enough that advantages, hence losses, are not zero."""
    return [float(len(set(c.split()))) + 0.1 * sum(len(w) for w in c.split()) for c in completions]


def grpo_args(steps_per_generation=1, num_iterations=1, max_steps=4, **extra):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=os.path.join(os.environ["AMEM_TEST_OUT"], "grpo"), use_cpu=True,
                      per_device_train_batch_size=2, num_generations=2,
                      steps_per_generation=steps_per_generation, num_iterations=num_iterations,
                      max_completion_length=COMPLETION_LEN, max_steps=max_steps, logging_steps=1,
                      report_to=[], save_strategy="no", seed=0, learning_rate=1e-2, beta=0.0,
                      disable_tqdm=True, **extra)


class Recorder:
    """What happened in one run, in order, on this rank."""

    def __init__(self, fake=None):
        self.events = []
        self.trainer = None
        self.callback = None
        self.fake = fake

    def state(self) -> dict:
        session = self.callback.session if self.callback else None
        # the callback's session: its phase while active, and its latest report as
        # it stands now (a begin or end still running says pending; nothing waits here)
        out = {"phase": session.phase if session is not None and session.active else None,
               "step": self.trainer._step if self.trainer else None}
        if session is not None and session.history:
            last = session.history[-1][1]
            out["last"] = [last.kind, last.pending]
        if self.fake is not None:
            out["suspended"] = self.fake.suspended()
        return out

    def note(self, what: str, settle: bool = False, **more) -> None:
        """``settle``: read the groups' state once an overlapped transition has
        finished (the callback overlaps by default; the strict stand-in NCCL,
        not this record, proves no collective met a suspended group meanwhile)."""
        policy = self.callback.policy if self.callback else None
        if settle and policy is not None:
            policy.wait()
        self.events.append({"what": what, **self.state(), **more})


RECORDER = Recorder()


def _record_policy_calls() -> None:
    """Every begin/end, with the micro-step it happened at (class-wide, once)."""
    if getattr(OffloadPolicy, "_recorded", False):
        return
    for kind in ("begin", "end"):
        original = getattr(OffloadPolicy, kind)

        def recorded(self, *args, _original=original, _kind=kind, **kwargs):
            report = _original(self, *args, **kwargs)
            RECORDER.note(_kind, settle=_kind == "end", skipped=report.skipped)
            return report

        setattr(OffloadPolicy, kind, recorded)
    OffloadPolicy._recorded = True


def spy_model_generate(trainer) -> None:
    original = trainer.model.generate

    def generate(*args, **kwargs):
        RECORDER.note("model.generate", settle=True)
        return original(*args, **kwargs)

    trainer.model.generate = generate


class UnevenTurns:
    """Mixin standing in for a tool loop: rank r calls the model r + 1 extra times
    per generation, before the regular call."""

    def _generate(self, prompts):
        prompt_ids, images, fields = self._tokenize_prompts(copy.deepcopy(prompts))
        for _ in range(dist.get_rank() + 1):
            self._generate_single_turn(prompt_ids, images, fields, self.num_generations)
        return super()._generate(prompts)


def train(callback_options=None, trainer_class=None, configure=None, fake=None, explicit=False,
          callback=None, **arg_options):
    """One GRPO run; returns its losses, metrics and what the recorder saw.
    ``callback``: an AMemCallback to reuse (it was detached from an earlier run)."""
    from trl import GRPOTrainer

    global RECORDER
    RECORDER = Recorder(fake)
    trainer_class = trainer_class or GRPOTrainer
    callbacks = []
    if callback is not None:
        RECORDER.callback = callback
        callbacks.append(callback)
    elif callback_options is not None:
        options = dict(callback_options)
        if options.get("backend") == "fake":
            options["backend"] = fake.backend()
        RECORDER.callback = AMemCallback(**options)
        if not explicit:
            callbacks.append(RECORDER.callback)
    trainer = trainer_class(model=model(), reward_funcs=reward, args=grpo_args(**arg_options),
                            train_dataset=dataset(), processing_class=tokenizer(),
                            callbacks=callbacks)
    RECORDER.trainer = trainer
    if explicit and RECORDER.callback is not None:
        RECORDER.callback.attach(trainer)
    if configure is not None:
        configure(trainer)
    spy_model_generate(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    callback = RECORDER.callback
    out = {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
           "reward": [h.get("reward") for h in logs], "events": RECORDER.events,
           "param_sum": float(sum(p.detach().double().sum() for p in trainer.model.parameters())),
           "amem_logs": [{k: v for k, v in h.items() if k.startswith("amem/")} for h in logs]}
    if callback is not None:
        policy = callback.policy
        out.update(counters=policy.metrics(last=False), kept=callback.kept, mode=callback.mode,
                   metrics=callback.metrics(),
                   begin_groups={g.name: [g.action, g.reason] for g in callback.last_begin.groups}
                   if callback.last_begin is not None else {},
                   waited_for_bytes=callback.last_begin.waited_for_bytes
                   if callback.last_begin is not None else None,
                   attached=callback.trainer is trainer,
                   registered=sum(cb is callback for cb in trainer.callback_handler.callbacks))
        callback.detach()
    return out


class _Seams(logging.Handler):
    """Where the adapter said each transition happened (its debug lines)."""

    def emit(self, record):
        message = record.getMessage()
        if "amem_callbacks: generation" in message or "vLLM server mode" in message:
            RECORDER.note("seam", line=message.split(": ", 1)[1])


def scenario_prelude(args):
    init()
    _record_policy_calls()
    amem_logger = logging.getLogger("amem_callbacks")
    amem_logger.setLevel(logging.DEBUG)
    amem_logger.addHandler(_Seams(logging.DEBUG))
    fake = None
    if args.get("backend") == "fake":
        from tests.scenarios import FakeNccl

        fake = FakeNccl()
    return fake


def cadence(args):
    """Baselines and callback runs for every steps_per_generation × num_iterations."""
    fake = scenario_prelude(args)
    options = {"backend": args.get("backend", "noop"), "agree_timeout_s": 20}
    configs = [(s, n) for s in (1, 2) for n in (1, 2)]
    runs = {}
    for spg, ni in configs:  # baselines first: before any policy exists in this process
        runs[f"{spg}x{ni}"] = {"baseline": train(steps_per_generation=spg, num_iterations=ni,
                                                 max_steps=args["max_steps"])}
    for spg, ni in configs:
        runs[f"{spg}x{ni}"]["amem"] = train(options, fake=fake, steps_per_generation=spg,
                                             num_iterations=ni, max_steps=args["max_steps"])
    return runs


def noop_runs(args):
    """Dry runs: ranks that call the model a different number of times per
    generation; generation that gathers parameters (FSDP, ZeRO-3)."""
    from trl import GRPOTrainer

    from amem_callbacks.adapters import _trl_groups as adapter_groups
    from amem_callbacks.groups import keep_name

    scenario_prelude(args)
    options = {"backend": "noop", "agree_timeout_s": 20}
    out = {}
    uneven = type("UnevenGRPOTrainer", (UnevenTurns, GRPOTrainer), {})
    out["uneven"] = {"baseline": train(trainer_class=uneven, max_steps=3),
                     "amem": train(options, trainer_class=uneven, max_steps=3, explicit=True)}

    def as_fsdp2(trainer):  # FSDP2 needs no summon_full_params: only the detection sees it
        trainer._dist.fsdp_version = 2

    out["fsdp"] = train(options, configure=as_fsdp2, max_steps=2)
    zero3_group = dist.new_group()
    layer = torch.nn.Linear(2, 2)
    layer.weight.ds_process_group = zero3_group  # what ZeRO-3 puts on its parameters
    zero3 = types.SimpleNamespace(_dist=types.SimpleNamespace(is_zero3=True, is_fsdp=False),
                                  model_wrapped=layer, use_vllm=False)
    found = adapter_groups.groups_generation_uses(zero3, "transformers")
    out["zero3"] = [[keep_name(g, role), why] for g, role, why in found]
    out["zero3_key"] = zero3_group.group_name
    return out


# --- vLLM stand-ins --------------------------------------------------------------
def _completion(seed: int, length: int) -> list:
    return [3 + (seed * 5 + j * 3) % (len(VOCAB) - 3) for j in range(length)] + [EOS]


class FakeServerClient:
    """Stands in for trl's VLLMClient on rank 0 (same return shape as its generate)."""

    def generate(self, prompts, features=None, n=1, **sampling):
        RECORDER.note("server.generate")
        prompt_ids, completions, logprobs = [], [], []
        for p in prompts:
            prompt_ids.append(list(p))
            for k in range(n):
                ids = _completion(sum(p) + k, 1 + (sum(p) + k) % COMPLETION_LEN)[:COMPLETION_LEN]
                completions.append(ids)
                logprobs.append([[-1.0] for _ in ids])
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}


def _vllm_generation(trainer, mode: str):
    from trl.generation.vllm_generation import VLLMGeneration

    vg = VLLMGeneration.__new__(VLLMGeneration)  # skip __init__: it starts vLLM
    vg.mode, vg.accelerator, vg.model = mode, trainer.accelerator, trainer.model
    vg.temperature, vg.top_p, vg.top_k, vg.min_p = 1.0, 1.0, 0, None
    vg.repetition_penalty, vg.max_completion_length = 1.0, COMPLETION_LEN
    vg.logprobs, vg.structured_outputs_regex, vg.generation_kwargs = 0, None, {}
    vg.sync_weights = lambda: RECORDER.note("sync_weights")
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation = True, mode, vg
    trainer.vllm_importance_sampling_correction = False
    trainer._last_loaded_step = -1
    return vg


def configure_server(trainer):
    vg = _vllm_generation(trainer, "server")
    if dist.get_rank() == 0:
        vg.vllm_client = FakeServerClient()


class _Logprob:
    def __init__(self, value):
        self.logprob, self.rank = value, 1


class FakeLLM:
    """Stands in for vLLM's LLM in colocate mode (sleep mode on)."""

    def __init__(self):
        self.awake = False

    def wake_up(self, tags=None):
        RECORDER.note("llm.wake_up", tags=tags)
        self.awake = True

    def sleep(self, level=1):
        self.awake = False

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        RECORDER.note("llm.generate")
        outputs = []
        for i, p in enumerate(prompts):
            ids = _completion(sum(p["prompt_token_ids"]) + i, 1 + i % COMPLETION_LEN)
            ids = ids[:COMPLETION_LEN]
            out = types.SimpleNamespace(token_ids=ids,
                                        logprobs=[{t: _Logprob(-1.0)} for t in ids])
            outputs.append(types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                                 outputs=[out]))
        return outputs


def configure_colocate(trainer):
    import trl.generation.vllm_generation as module

    vg = _vllm_generation(trainer, "colocate")
    vg.llm, vg.enable_sleep_mode, vg._llm_weights_sleeping = FakeLLM(), True, False
    vg.tensor_parallel_size = dist.get_world_size()
    vg.tp_group, _ = dist.new_subgroups_by_enumeration([list(range(dist.get_world_size()))])
    module.SamplingParams = lambda **kwargs: kwargs  # vLLM's class; not installed here
    # vLLM builds its own groups in the trainer's processes: one stands in for them.
    if "vllm.distributed.parallel_state" not in sys.modules:
        state = types.ModuleType("vllm.distributed.parallel_state")
        state._TP = types.SimpleNamespace(device_group=dist.new_group(), cpu_group=None)
        sys.modules[state.__name__] = state


MIB = 2**20


def fake_cumem(kv_asleep_mib: int = 200, weights_mib: int = 300) -> None:
    """vLLM's CuMemAllocator singleton as its sleep mode leaves it between sleep and
    the KV wake-up (vllm/device_allocator/cumem.py: handle = (device, size, pointer,
    cuMem handle)): the weights woken, the KV cache asleep."""
    module = types.ModuleType("vllm.device_allocator.cumem")

    def row(tag, mib, asleep, pointer):
        return types.SimpleNamespace(handle=(0, mib * MIB, pointer, 0), tag=tag,
                                     is_asleep=asleep, cpu_backup_tensor=None)

    table = {1: row("weights", weights_mib, False, 1), 2: row("kv_cache", kv_asleep_mib, True, 2)}
    module.CuMemAllocator = types.SimpleNamespace(
        instance=types.SimpleNamespace(pointer_to_data=table))
    sys.modules[module.__name__] = module


def colocate_allocating(args):
    """Colocate runs whose begin before the KV wake-up is told what vLLM maps next
    (its allocator, faked) and the free memory (faked: CPU has none to read):
    ``free`` 64 GiB fits, 0 lacks, None is unknown."""
    import amem_callbacks.adapters.trl as trl_adapter
    import amem_callbacks.headroom as headroom_module
    import amem_callbacks.session as session_module

    fake = scenario_prelude(args)
    baseline = train(configure=configure_colocate, max_steps=2)
    # 300 MiB: with the 256 MiB margin more than one of the fake's two 480 MiB groups,
    # so a begin that lacks it waits for both. Waiting for one, the other's suspend
    # could end during generate, where the faked free memory (a constant) does not rise
    # with it, and the next estimate would count those bytes as the generation's.
    fake_cumem(kv_asleep_mib=300)
    free = {"now": args["free"]}
    session_module.device_free_bytes = lambda device=None: free["now"]
    # torch's allocator (CPU has none): grows by ``generation_mib`` in the first generate
    reserved = {"now": 0}
    trl_adapter.torch_reserved_bytes = lambda device=None: reserved["now"]

    class Measured(FakeLLM):
        """``neighbour_mib``: another rank on the GPU maps its KV cache while this one
        generates (the free memory drops by that until the next wake-up); it is not this
        rank's take."""
        generations = 0

        def wake_up(self, tags=None):
            free["now"] = args["free"]
            super().wake_up(tags)

        def generate(self, *a, **k):
            self.generations += 1
            if self.generations == 1:
                reserved["now"] += args.get("generation_mib", 0) * MIB
            if free["now"] is not None:
                free["now"] -= args.get("neighbour_mib", 0) * MIB
            return super().generate(*a, **k)

    def configure(trainer):
        configure_colocate(trainer)
        trainer.vllm_generation.llm = Measured()
    # no GPU total unless ``total`` says (on a GPU host too): what comes is then the
    # faked KV cache alone; with one, vLLM's whole budget at the first generation
    trl_adapter.gpu_total_bytes = lambda device=None: args.get("total")
    # the headroom line's GPU: 80 GiB (the free memory after generate bounds the raise)
    headroom_module.gpu_total_bytes = lambda device=None: 80 * 2**30
    options = {"backend": "fake", "agree_timeout_s": 20, "overlap": True}
    run = train(options, configure=configure, fake=fake, max_steps=2)
    del sys.modules["vllm.device_allocator.cumem"]
    return {"baseline": baseline, "amem": run}


class ShortWake(FakeLLM):
    """vLLM's cuMem wake-up where the free memory fell short on one rank (or "all"): the
    KV wake-ups listed in ``short_at`` (counted from 1) raise there as vLLM 0.31's does,
    once each; the next call maps (vLLM maps what is still asleep). ``error`` replaces
    the out-of-memory text (another failure)."""

    def __init__(self, short_rank, short_at, error=None):
        super().__init__()
        self.short_rank, self.short_at, self.error = short_rank, set(short_at), error
        self.kv_woken = 0  # KV wake-ups that mapped: the generation is the next one

    def wake_up(self, tags=None):
        if tags is None or "kv_cache" in tags:
            generation = self.kv_woken + 1
            if self.short_rank in (dist.get_rank(), "all") and generation in self.short_at:
                self.short_at.discard(generation)
                RECORDER.note("llm.wake_up fell short", tags=tags)
                raise RuntimeError(self.error or "CUDA Error: out of memory at "
                                   "/workspace/csrc/cumem_allocator.cpp:163")
            self.kv_woken += 1
        super().wake_up(tags)


def colocate_short_wake(args):
    """Colocate runs where every rank's begin before the KV wake-up is skipped from
    the second generation on (the free memory, faked, fits), but one rank's wake-up
    runs out of memory anyway at the generations ``short_at``."""
    import amem_callbacks.adapters.trl as trl_adapter
    import amem_callbacks.session as session_module

    fake = scenario_prelude(args)
    baseline = train(configure=configure_colocate, max_steps=3)
    fake_cumem()
    session_module.device_free_bytes = lambda device=None: 64 * 2**30
    trl_adapter.torch_reserved_bytes = lambda device=None: 0  # no generation takes more
    trl_adapter.gpu_total_bytes = lambda device=None: None

    def configure(trainer):
        configure_colocate(trainer)
        trainer.vllm_generation.llm = ShortWake(args["short_rank"], args["short_at"],
                                                args.get("error"))

    options = {"backend": "fake", "agree_timeout_s": 20, "overlap": True}
    try:
        run = train(options, configure=configure, fake=fake, max_steps=3)
    except RuntimeError as error:  # another failure than memory: it reaches the trainer
        callback = RECORDER.callback
        run = {"raised": str(error), "metrics": callback.metrics(),
               "counters": callback.policy.metrics(last=False)}
    del sys.modules["vllm.device_allocator.cumem"]
    return {"baseline": baseline, "amem": run}


def vllm_modes(args):
    """Server and colocate runs, each against a baseline without the callback."""
    fake = scenario_prelude(args)
    options = {"backend": args.get("backend", "noop"), "agree_timeout_s": 20,
               "overlap": args.get("overlap", False)}
    out = {}
    for mode, configure in (("server", configure_server), ("colocate", configure_colocate)):
        out[mode] = {"baseline": train(configure=configure, max_steps=3)}
    out["server"]["amem"] = train(dict(options, suspend_in_server_mode=True),
                                  configure=configure_server, fake=fake, max_steps=3)
    out["server"]["default"] = train(options, configure=configure_server, fake=fake, max_steps=3)
    # One callback serves a colocate run, is detached, then serves a second trainer:
    # its hooks must be in place again (the second run is the one checked below).
    reused = AMemCallback(**dict(options, backend=fake.backend() if fake else options["backend"]))
    out["colocate"]["first_of_two"] = train(callback=reused, configure=configure_colocate,
                                            fake=fake, max_steps=1)
    out["colocate"]["amem"] = train(callback=reused, configure=configure_colocate, fake=fake,
                                    max_steps=3)
    return out

