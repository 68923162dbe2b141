"""TRL: ``AMemCallback`` frees idle NCCL memory while a GRPO trainer generates.

Where a generation phase starts and ends (read from trl 1.16; ``GRPOTrainer``
and ``RLOOTrainer`` share the structure):

- ``_generate`` runs once per generation on every rank; the steps served from
  the buffer (``steps_per_generation``, ``num_iterations``) never reach it. It
  frames the phase, and a phase takes at most one suspend and one resume, so
  tool loops that call the model a different number of times on different
  ranks still make the same collective calls everywhere.
- Suspend: at the first generation call inside it, after the weights were
  synced to vLLM (that sync may gather parameters). transformers:
  ``_generate_single_turn`` (or ``rollout_func``); vLLM colocate: the KV-cache
  ``wake_up`` or ``LLM.generate``, so the memory is free before vLLM takes it;
  vLLM server: after the prompts were gathered, while rank 0 waits for the
  server.
- Resume: at the first accelerator collective inside ``_generate`` (the
  ``gather`` of the completion lengths), at the broadcast of the server's
  completions, or when ``_generate`` returns, whichever comes first: always
  before the logprob forwards.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Iterable, Mapping, Optional, Union

from transformers import TrainerCallback

from amem_callbacks import OffloadPolicy, name_group

logger = logging.getLogger("amem_callbacks")

PHASE = "rollout"
_IDLE, _PENDING, _ACTIVE, _DONE = "idle", "pending", "active", "done"
# Accelerator methods that are collective: the first one inside generation ends the phase.
_ACCELERATOR_COLLECTIVES = ("gather", "gather_for_metrics", "reduce", "pad_across_processes",
                            "wait_for_everyone")
_POLICY_OPTIONS = frozenset({"min_bytes", "timeout_s", "agree_timeout_s", "host_memory_cap_bytes",
                             "groups", "backend_options"})
# Callbacks whose trainer is inside a vLLM server-mode generate call (see _server_broadcast).
_in_server_call: list = []


class AMemCallback(TrainerCallback):
    """Suspends the NCCL groups generation leaves idle, and resumes them before the
    first collective after it. Add it to ``callbacks=``; nothing else to call.

    Args:
        backend: "auto" (NCCL's own suspend, then AMem, else training runs
            unchanged), "nccl", "amem", "noop" (dry run), or a Backend instance.
        keep: groups to leave active during generation (see ``OffloadPolicy``).
            The groups generation itself uses are added by the callback: vLLM's
            tensor-parallel group, and the default group where FSDP or
            DeepSpeed ZeRO-3 gathers parameters while the model generates.
        guard: "resume", "strict" or "off" (see ``OffloadPolicy``).
        overlap: suspend in the background while the model generates.
        suspend_in_server_mode: with ``vllm_mode="server"`` generation runs on
            the server's GPUs and nothing on the trainer's GPUs can use freed
            memory meanwhile, so by default nothing is suspended there (one
            log line says so); True suspends anyway.
        log_metrics: add the ``amem/...`` figures to the trainer's logs, so they
            reach whatever ``report_to`` names.
        **policy_options: ``min_bytes``, ``timeout_s``, ``agree_timeout_s``,
            ``host_memory_cap_bytes``, ``groups``, ``backend_options``.

    Attributes:
        policy: the :class:`~amem_callbacks.OffloadPolicy`, built at the first
            generation (once the groups are known).
        kept: group name -> why generation needs it active.
        last_begin, last_end: this rank's last transition reports.

    Example:
        >>> from amem_callbacks.adapters.trl import AMemCallback
        >>> trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
        ...                       train_dataset=dataset, callbacks=[AMemCallback()])
        >>> trainer.train()
    """

    def __init__(self, backend: Union[str, object] = "auto",
                 keep: Union[Iterable[str], Mapping[str, Iterable[str]]] = (), *,
                 guard: str = "resume", overlap: bool = False, log_metrics: bool = True,
                 suspend_in_server_mode: bool = False, **policy_options):
        unknown = sorted(set(policy_options) - _POLICY_OPTIONS)
        if unknown:
            raise ValueError(f"AMemCallback got unknown option(s) {unknown}: use backend, keep, "
                             f"guard, overlap, log_metrics or {sorted(_POLICY_OPTIONS)}")
        for flag, value in (("log_metrics", log_metrics),
                            ("suspend_in_server_mode", suspend_in_server_mode)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag} must be True or False, got {value!r}")
        self.suspend_in_server_mode = suspend_in_server_mode
        self._policy_kwargs = dict(backend=backend, keep=keep, guard=guard, overlap=overlap,
                                   **policy_options)
        OffloadPolicy(**self._policy_kwargs)  # bad options fail here, not at the first generation
        self.log_metrics = log_metrics
        self.policy: Optional[OffloadPolicy] = None
        self.trainer = None
        self.kept: dict = {}
        self.mode: Optional[str] = None
        self._window = _IDLE
        self._in_vllm_call = False
        self.last_begin = None
        self.last_end = None
        self._wrapped: list = []

    # --- finding and handing over the trainer ------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            trainer = self._find_trainer()
            if trainer is not None:
                self.attach(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            trainer = self._find_trainer()
            if trainer is None:
                raise RuntimeError("AMemCallback could not find the trainer it was added to; "
                                   "hand it over with callback.attach(trainer)")
            self.attach(trainer)

    def _find_trainer(self):
        """The Trainer up the call stack whose callback handler holds this callback:
        Trainer events pass the model and optimizer, never the trainer itself."""
        frame = inspect.currentframe()
        try:
            while frame is not None:
                candidate = frame.f_locals.get("self")
                handler = getattr(candidate, "callback_handler", None)
                if any(cb is self for cb in getattr(handler, "callbacks", ())):
                    return candidate
                frame = frame.f_back
        finally:
            del frame
        return None

    def attach(self, trainer) -> "AMemCallback":
        """Serve ``trainer`` (the explicit form; ``callbacks=[...]`` does it by itself).

        Adds the callback to the trainer's callbacks if it is not there yet.
        """
        if self.trainer is trainer:
            return self
        if self.trainer is not None:
            raise ValueError("this AMemCallback already serves another trainer: create one per "
                             "trainer")
        generate = getattr(trainer, "_generate", None)
        if not callable(generate) or not hasattr(trainer, "accelerator"):
            raise ValueError(f"AMemCallback frames generation in trainers that generate "
                             f"(GRPOTrainer, RLOOTrainer); {type(trainer).__name__} does not")
        if getattr(generate, "__amem_trl__", False):
            raise ValueError("this trainer already has an AMemCallback: add only one")
        handler = trainer.callback_handler
        if not any(cb is self for cb in handler.callbacks):
            trainer.add_callback(self)
        self.trainer = trainer
        self._wrap(trainer, "_generate", self._around_generate)
        self._wrap(trainer, "_generate_single_turn", self._before_call(
            "transformers generation", lambda: self.mode == "transformers"))
        self._wrap(trainer, "log", self._log_with_metrics)
        for name in _ACCELERATOR_COLLECTIVES:
            self._wrap(trainer.accelerator, name, self._ending_before(f"accelerator.{name}"))
        return self

    def detach(self) -> None:
        """Undo :meth:`attach` (outside generation): the trainer runs as without the callback."""
        for owner, name, original, own in reversed(self._wrapped):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._wrapped = []
        # The next attach() may serve another trainer: its first generation
        # decides mode, kept groups and hooks afresh.
        self.policy, self.kept, self.mode = None, {}, None
        if self in _in_server_call:
            _in_server_call.remove(self)
        trainer, self.trainer = self.trainer, None
        if trainer is not None and any(cb is self for cb in trainer.callback_handler.callbacks):
            trainer.remove_callback(self)

    def _wrap(self, owner, name: str, around) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            return around(original, *args, **kwargs)

        wrapped.__amem_trl__ = True
        self._wrapped.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, wrapped)

    # --- the phase ------------------------------------------------------------
    def _around_generate(self, original, *args, **kwargs):
        self._prepare()
        self._window = _PENDING
        try:
            result = original(*args, **kwargs)
            self._end("end of _generate")
        finally:
            # After an exception the groups stay as they are: resuming is
            # collective and the other ranks may be elsewhere; the guard
            # resumes a group the program uses again.
            self._window = _IDLE
        if self.policy.overlap:
            self.policy.wait()  # DDP's own C++ collectives come next and bypass the guard
        return result

    def _begin(self, where: str) -> None:
        if self._window != _PENDING:
            return
        self._window = _ACTIVE
        logger.debug("amem_callbacks: generation starts (%s): begin", where)
        self.last_begin = self.policy.begin(PHASE)

    def _end(self, where: str) -> None:
        if self._window != _ACTIVE:
            return
        self._window = _DONE
        logger.debug("amem_callbacks: generation over (%s): end", where)
        self.last_end = self.policy.end(PHASE)
        if self.policy.overlap and self.policy.guard_mode == "off":
            self.policy.wait()  # nothing else would wait for the resume before the next call

    def _before_call(self, where: str, applies=lambda: True):
        def around(original, *args, **kwargs):
            if applies():
                self._begin(where)
            return original(*args, **kwargs)
        return around

    def _ending_before(self, where: str):
        def around(original, *args, **kwargs):
            self._end(where)
            return original(*args, **kwargs)
        return around

    # --- set-up at the first generation ----------------------------------------
    def _prepare(self) -> None:
        """At the first generation after attach (everything, vLLM included,
        exists by now): the policy and the generation-mode hooks."""
        if self.policy is None:
            self._make_policy()
            self._hook_generation()

    def _make_policy(self) -> None:
        trainer = self.trainer
        self.mode = _generation_mode(trainer)
        needed = _groups_generation_uses(trainer, self.mode)
        names = []
        for group, role, why in needed:
            name = _keep_name(group, role)
            names.append(name)
            self.kept.setdefault(name, why)
        keep = _merge_keep(self._policy_kwargs["keep"], PHASE, names)
        self.policy = OffloadPolicy(**{**self._policy_kwargs, "keep": keep})
        if self.kept:
            level = logging.WARNING if "world" in self.kept else logging.INFO
            logger.log(level, "amem_callbacks: generation uses these groups, kept active: %s",
                       "; ".join(f"{name!r} ({why})" for name, why in self.kept.items()))

    def _hook_generation(self) -> None:
        trainer = self.trainer
        if self.mode == "vllm-server" and not self.suspend_in_server_mode:
            logger.info("amem_callbacks: vLLM server mode: generation runs on the server's GPUs, "
                        "so no memory freed here could serve it; nothing is suspended (pass "
                        "AMemCallback(suspend_in_server_mode=True) to suspend anyway)")
            return
        if self.mode == "transformers" and getattr(trainer, "rollout_func", None) is not None:
            self._wrap(trainer, "rollout_func", self._before_call("rollout_func"))
        elif self.mode == "vllm-colocate":
            self._hook_colocate(trainer.vllm_generation)
        elif self.mode == "vllm-server":
            self._hook_server(trainer.vllm_generation)
        elif self.mode is None:
            logger.warning("amem_callbacks: unknown vLLM mode %r: nothing is suspended",
                           getattr(getattr(trainer, "vllm_generation", None), "mode", None))

    def _hook_colocate(self, vllm_generation) -> None:
        llm = vllm_generation.llm

        def wake_up(original, *args, **kwargs):
            tags = kwargs.get("tags", args[0] if args else None)
            if tags is None or "kv_cache" in tags:
                self._begin("vLLM KV-cache wake-up")
                if self.policy.overlap:
                    self.policy.wait()  # the KV cache needs the memory now
            return original(*args, **kwargs)

        self._wrap(llm, "wake_up", wake_up)
        self._wrap(llm, "generate", self._before_call("vLLM generate"))

    def _hook_server(self, vllm_generation) -> None:
        """Rank 0 suspends right before its request to the server; the other ranks
        when they reach the broadcast of the completions, where everyone resumes."""
        def in_call(original, *args, **kwargs):
            self._in_vllm_call = True
            _in_server_call.append(self)
            try:
                return original(*args, **kwargs)
            finally:
                self._in_vllm_call = False
                _in_server_call.remove(self)

        self._wrap(vllm_generation, "generate", in_call)
        client = getattr(vllm_generation, "vllm_client", None)  # rank 0 only
        if client is not None:
            request = self._before_call("vLLM server request", lambda: self._in_vllm_call)
            for name in ("image_features", "generate"):
                self._wrap(client, name, request)
        _install_broadcast_hook()

    def _server_broadcast(self) -> None:
        self._begin("waiting for the vLLM server")
        self._end("broadcast of the server's completions")

    # --- metrics ------------------------------------------------------------------
    def metrics(self, prefix: str = "amem/") -> dict:
        """This rank's running totals and its last begin and end, flat."""
        if self.policy is None:
            return {}
        out = self.policy.counters.as_dict(prefix)
        out[prefix + "inert"] = int(self.policy.inert)
        for report in (self.last_begin, self.last_end):
            if report is not None and not report.pending and not report.skipped:
                out.update(report.as_dict(prefix))
        return out

    def _log_with_metrics(self, original, logs, *args, **kwargs):
        # Eval logs are prefixed by the trainer from their first key: leave them alone.
        if (self.log_metrics and self.policy is not None and isinstance(logs, dict) and logs
                and (self.policy.counters.begins or self.policy.inert)
                and not str(next(iter(logs))).startswith("eval_")):
            logs.update(self.metrics())
        return original(logs, *args, **kwargs)


def _generation_mode(trainer) -> Optional[str]:
    if not getattr(trainer, "use_vllm", False):
        return "transformers"
    mode = getattr(getattr(trainer, "vllm_generation", None), "mode", None)
    return f"vllm-{mode}" if mode in ("colocate", "server") else None


def _groups_generation_uses(trainer, mode) -> list:
    """``(process group, role or None, why)`` for each group that generation itself calls."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    world = dist.distributed_c10d._get_default_group()
    found = []
    vllm_generation = getattr(trainer, "vllm_generation", None)
    if mode == "vllm-colocate":
        tp_group = getattr(vllm_generation, "tp_group", None)
        if tp_group is not None:
            found.append((tp_group, "vllm_tp", "vLLM gathers the prompts over it"))
        for group in _vllm_own_groups():
            found.append((group, "vllm", "vLLM's own group"))
        if (getattr(vllm_generation, "tensor_parallel_size", 1) > 1
                and _is_peft(getattr(trainer, "model", None))):
            found.append((world, None, "TRL calls a barrier on it before each vLLM generate "
                                       "(PEFT with tensor_parallel_size > 1)"))
    # Generation that may sync weights again inside the phase (several calls per phase).
    several_calls = any(getattr(trainer, name, None) for name in
                        ("tools", "rollout_func", "environment_factories"))
    gathers = mode == "transformers" or (
        mode == "vllm-colocate" and getattr(vllm_generation, "enable_sleep_mode", False)
        and several_calls)
    sharding = _sharding(trainer)
    if gathers and sharding:
        why = f"{sharding} gathers parameters on it while generating"
        found.append((world, None, why))
        model = getattr(trainer, "model_wrapped", None) or getattr(trainer, "model", None)
        found.extend((group, None, why) for group in _sharding_groups(model))
    return found


def _sharding(trainer) -> Optional[str]:
    backend = getattr(trainer, "_dist", None)
    if backend is not None:
        if getattr(backend, "is_zero3", False):
            return "DeepSpeed ZeRO-3"
        if getattr(backend, "is_fsdp", False):
            return "FSDP"
        return None
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is not None and getattr(plugin, "zero_stage", 0) == 3:
        return "DeepSpeed ZeRO-3"
    if getattr(state, "fsdp_plugin", None) is not None:
        return "FSDP"
    return None


def _sharding_groups(model) -> list:
    """Groups the parameters are sharded over: FSDP1 wrappers' ``process_group``,
    FSDP2 DTensors' mesh, ZeRO-3 parameters' ``ds_process_group``."""
    if model is None:
        return []
    groups = {}
    for module in model.modules():
        group = getattr(module, "process_group", None)
        if group is not None and type(module).__name__ == "FullyShardedDataParallel":
            groups[id(group)] = group
    for param in model.parameters():
        group = getattr(param, "ds_process_group", None)
        if group is not None:
            groups[id(group)] = group
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            for group in mesh.get_all_groups():
                groups[id(group)] = group
    return list(groups.values())


def _vllm_own_groups() -> list:
    """The NCCL groups of vLLM's GroupCoordinators (colocate mode builds them in this process)."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is None:
        return []
    groups = {}
    for value in list(vars(state).values()):
        group = getattr(value, "device_group", None) if not isinstance(value, type) else None
        if group is not None and hasattr(group, "group_name"):
            groups[id(group)] = group
    return list(groups.values())


def _is_peft(model) -> bool:
    try:
        from accelerate.utils import is_peft_model
    except ImportError:
        return False
    return model is not None and is_peft_model(model)


def _keep_name(group, role: Optional[str]) -> str:
    """A name for ``keep``: "world" for the default group, else a role or the group key."""
    from torch.distributed import distributed_c10d as c10d

    if group is c10d._get_default_group():
        return "world"
    if role:
        name_group(group, role)
        return role
    return group.group_name


def _merge_keep(keep, phase: str, extra: list):
    if not extra:
        return keep
    if isinstance(keep, Mapping):
        merged = {p: list(names) for p, names in keep.items()}
    else:
        merged = {"*": list(keep)}
    merged[phase] = sorted(set(merged.get(phase, ())) | set(extra))
    return merged


def _install_broadcast_hook() -> None:
    """Server mode: every rank meets at the broadcast of the server's completions
    (``accelerate.utils.broadcast_object_list``, as bound in trl's vLLM module)."""
    module = sys.modules.get("trl.generation.vllm_generation")
    original = getattr(module, "broadcast_object_list", None)
    if original is None or getattr(original, "__amem_trl__", False):
        return

    @functools.wraps(original)
    def broadcast_object_list(*args, **kwargs):
        for callback in list(_in_server_call):
            callback._server_broadcast()
        return original(*args, **kwargs)

    broadcast_object_list.__amem_trl__ = True
    module.broadcast_object_list = broadcast_object_list
