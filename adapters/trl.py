"""TRL 1.16: ``AMemCallback`` frees idle NCCL memory while a GRPO (or RLOO) trainer
generates (where each phase starts and ends, what stays active: docs/trl.md)."""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Iterable, Mapping, Optional, Union

from amem_callbacks import OffloadPolicy, host_backup
from amem_callbacks.checks import check_bool
from amem_callbacks.errors import AdapterError, OptionError
from amem_callbacks.groups import keep_name, register_roles
from amem_callbacks.headroom import gpu_total_bytes
from amem_callbacks.log import logger
from amem_callbacks.memory import torch_reserved_bytes
from amem_callbacks.options import OffloadOptions
from amem_callbacks.patching import Patches
from amem_callbacks.session import RolloutSession, SessionViews

from ._options_map import map_options
from ._trl_groups import generation_mode, groups_generation_uses, needs_settle_after_generate
from ._vllm_memory import is_out_of_memory, upcoming_bytes

try:
    from transformers import TrainerCallback
except ImportError as exc:  # the extra was not installed
    raise ImportError("amem_callbacks.adapters.trl needs TRL and transformers: "
                      "pip install 'amem-callbacks[trl]'") from exc

PHASE = "rollout"
# Accelerator methods that are collective: the first one inside generation ends the phase.
_ACCELERATOR_COLLECTIVES = ("gather", "gather_for_metrics", "reduce", "pad_across_processes",
                            "wait_for_everyone")
#: Free memory that must stay beyond vLLM's KV wake-up and the last generation's take
#: for a begin to be skipped. Smaller than the headroom line's 0.5 GiB: the wake-up's
#: size is vLLM's own (exact), and a wake-up that falls short anyway is caught
#: (_wake_after_skipped_begin); this covers a generation taking more than the last.
WAKE_MARGIN_BYTES = 256 * 2**20
#: AMemCallback keyword -> OffloadOptions field (TRL users write the policy's own names).
OPTION_NAMES = {name: name for name in OffloadOptions.names()}
# Callbacks whose trainer is inside a vLLM server-mode generate call (see _server_broadcast).
_in_server_call: list = []

register_roles(("vllm_tp", "vllm"))


class AMemCallback(TrainerCallback, SessionViews):
    """Suspends the NCCL groups generation leaves idle, and resumes them before the
    first collective after it. Add it to ``callbacks=``; nothing else to call.

    The options are in docs/trl.md: ``backend``, ``keep`` (the groups generation
    itself uses are added), ``guard``, ``overlap``, ``log_metrics`` (``amem/...`` in
    the trainer's logs), ``suspend_in_server_mode`` (vLLM server mode suspends
    nothing unless True: no memory freed here could serve the server), and any
    other :class:`~amem_callbacks.OffloadOptions` field.
    """

    def __init__(self, backend: Union[str, object] = "auto",
                 keep: Union[Iterable[str], Mapping[str, Iterable[str]]] = (), *,
                 guard: str = "resume", overlap: bool = True, log_metrics: bool = True,
                 suspend_in_server_mode: bool = False, **policy_options):
        check_bool("log_metrics", log_metrics)
        check_bool("suspend_in_server_mode", suspend_in_server_mode)
        given = dict(backend=backend, keep=keep, guard=guard, overlap=overlap, **policy_options)
        # Bad options fail here, not at the first generation.
        self.options = OffloadOptions(**map_options("AMemCallback", OPTION_NAMES, given))
        # made before the trainer, so before its first collective starts NCCL's runtime
        host_backup.prepare(self.options)
        self.suspend_in_server_mode = suspend_in_server_mode
        self.log_metrics = log_metrics
        self.trainer = None
        self._patches = Patches()
        self._reset()

    def _reset(self) -> None:
        """What one attach() learns at its first generation."""
        self.session: Optional[RolloutSession] = None  # made at the first generation
        self.kept: dict = {}
        self.mode: Optional[str] = None
        self._inside_generate = False  # between _generate's start and its return
        self._phase_done = False  # this _generate already had its begin and end
        self._hooked = False
        self._settle_after_generate = True
        self._headroom_from = None  # the begin the headroom line is read from
        self._free_at_fullest = None  # this rank's free memory after vLLM generated
        self._at_kv_wake = None  # torch's reserved bytes after the KV wake-up
        self._generation_bytes = None  # what the last generation took beyond its KV wake-up

    # --- finding and handing over the trainer ------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        self._attach_found(required=False)

    def on_train_begin(self, args, state, control, **kwargs):
        self._attach_found(required=True)

    def _attach_found(self, required: bool) -> None:
        """Attach the Trainer up the call stack whose callback handler holds this
        callback: Trainer events pass the model and optimizer, never the trainer."""
        frame = inspect.currentframe()
        try:
            while self.trainer is None and frame is not None:
                candidate = frame.f_locals.get("self")
                handler = getattr(candidate, "callback_handler", None)
                if any(cb is self for cb in getattr(handler, "callbacks", ())):
                    self.attach(candidate)
                frame = frame.f_back
        finally:
            del frame
        if self.trainer is None and required:
            raise AdapterError("AMemCallback could not find the trainer it was added to; "
                               "hand it over with callback.attach(trainer)")

    def attach(self, trainer) -> "AMemCallback":
        """Serve ``trainer`` (the explicit form; ``callbacks=[...]`` does it by itself);
        adds the callback to the trainer's callbacks if it is not there yet."""
        if trainer is None:
            raise OptionError("attach() needs the trainer to serve, e.g. "
                             "AMemCallback().attach(trainer), got None")
        if self.trainer is trainer:
            return self
        if self.trainer is not None:
            raise OptionError("this AMemCallback already serves another trainer: create one per "
                             "trainer")
        if not callable(getattr(trainer, "_generate", None)) or not hasattr(trainer, "accelerator"):
            raise OptionError(f"AMemCallback frames generation in trainers that generate "
                             f"(GRPOTrainer, RLOOTrainer); {type(trainer).__name__} does not")
        if not self._patches.wrap(trainer, "_generate", self._around_generate):
            raise OptionError("this trainer already has an AMemCallback: add only one")
        if not any(cb is self for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(self)
        self.trainer = trainer
        self._patches.wrap(trainer, "_generate_single_turn", before=self._starting(
            "transformers generation", lambda: self.mode == "transformers"))
        self._patches.wrap(trainer, "log", self._log_with_metrics)
        for name in _ACCELERATOR_COLLECTIVES:
            self._patches.wrap(trainer.accelerator, name,
                               before=lambda *a, _n=name, **k: self._stop(f"accelerator.{_n}"))
        return self

    def detach(self) -> None:
        """Undo :meth:`attach` (outside generation): the trainer runs as without the callback."""
        self._patches.undo()
        if self in _in_server_call:
            _in_server_call.remove(self)
        trainer, self.trainer = self.trainer, None
        self._reset()  # the next attach() may serve another trainer: decide afresh
        if trainer is not None and any(cb is self for cb in trainer.callback_handler.callbacks):
            trainer.remove_callback(self)

    # --- the phase ------------------------------------------------------------
    def _around_generate(self, original, *args, **kwargs):
        if self.mode is None and not self._hooked:  # first generation: vLLM exists by now
            self._hook_generation()
        self._inside_generate, self._phase_done = True, False
        try:
            result = original(*args, **kwargs)
            self._stop("end of _generate")
        finally:
            # After an exception the groups stay as they are: resuming is
            # collective and the other ranks may be elsewhere; the guard
            # resumes a group the program uses again.
            self._inside_generate = False
        if self.session is not None and self._settle_after_generate:
            self.session.settle()  # collectives the guard cannot see come next
        self._tell_headroom()
        return result

    def _start(self, where: str, memory_needed_now: bool = False,
               allocating_bytes: Optional[int] = None) -> bool:
        """``memory_needed_now``: something allocates right after; with
        ``allocating_bytes`` (how much), the begin waits only for what the free
        memory lacks, else for all of it. True where every rank skipped the begin
        (nothing lacked): the allocation then reports whether it fell short."""
        if (not self._inside_generate or self._phase_done or self.session is None
                or self.session.active or self._suspends_nothing()):
            return False
        logger.debug("amem_callbacks: generation starts (%s): begin", where)
        if not memory_needed_now:
            self.session.start(where, need_bytes=0)
        elif allocating_bytes is not None:
            report = self.session.start(where, allocating_bytes=allocating_bytes,
                                        margin_bytes=WAKE_MARGIN_BYTES)
            if report is not None and report.skipped:  # every rank agreed nothing lacks:
                self._phase_done = True  # no begin in this generation (nor an end)
                return True
            self._headroom_from = report
        else:
            self._headroom_from = self.session.start(where, need_bytes=None)
        return False

    def _tell_headroom(self) -> None:
        """vLLM colocated: how far its share can go, from a begin that has finished
        (one that did not wait may still be running: the next one tells) and the free
        memory vLLM's generate left (at a share that already uses the freed memory,
        less than it freed)."""
        report, self._headroom_from = self._headroom_from, None
        free, self._free_at_fullest = self._free_at_fullest, None
        if report is not None and not report.pending and self.session is not None:
            self.session.tell_headroom("vllm_gpu_memory_utilization", self._share(), report,
                                       free_at_fullest=free)

    def _share(self) -> Optional[float]:
        return getattr(getattr(self.trainer, "args", None), "vllm_gpu_memory_utilization", None)

    def _stop(self, where: str) -> None:
        if self.session is None or not self.session.active:
            return
        self._phase_done = True
        logger.debug("amem_callbacks: generation over (%s): end", where)
        # Until _generate returns, TRL's own calls are torch.distributed ones (the guard
        # holds each back until its group is back); settle() before DDP comes next.
        self.session.stop(where, guarded_until_settle=True)

    def _starting(self, where: str, applies=lambda: True):
        def before(*args, **kwargs):
            if applies():
                self._start(where)
        return before

    def _suspends_nothing(self) -> bool:
        return self.mode == "vllm-server" and not self.suspend_in_server_mode

    # --- set-up at the first generation ----------------------------------------
    def _make_policy(self) -> OffloadPolicy:
        names = []
        for group, role, why in groups_generation_uses(self.trainer, self.mode):
            names.append(keep_name(group, role))
            self.kept.setdefault(names[-1], why)
        if self.kept:
            level = logging.WARNING if "world" in self.kept else logging.INFO
            logger.log(level, "amem_callbacks: generation uses these groups, kept active: %s",
                       "; ".join(f"{name!r} ({why})" for name, why in self.kept.items()))
        return OffloadPolicy(self.options.keeping(PHASE, names))

    def _hook_generation(self) -> None:
        trainer = self.trainer
        self.mode = generation_mode(trainer)
        self._hooked = True
        self.session = RolloutSession(self._make_policy())
        self._settle_after_generate = needs_settle_after_generate(trainer)
        if self._suspends_nothing():
            logger.info("amem_callbacks: vLLM server mode: generation runs on the server's GPUs, "
                        "so no memory freed here could serve it; nothing is suspended (pass "
                        "AMemCallback(suspend_in_server_mode=True) to suspend anyway)")
            return
        if self.mode == "transformers" and getattr(trainer, "rollout_func", None) is not None:
            self._patches.wrap(trainer, "rollout_func", before=self._starting("rollout_func"))
        elif self.mode == "vllm-colocate":
            self._hook_colocate(trainer.vllm_generation)
        elif self.mode == "vllm-server":
            self._hook_server(trainer.vllm_generation)
        elif self.mode is None:
            logger.warning("amem_callbacks: unknown vLLM mode %r: nothing is suspended",
                           getattr(getattr(trainer, "vllm_generation", None), "mode", None))

    def _hook_colocate(self, vllm_generation) -> None:
        def kv_tags(args, kwargs):
            """The wake-up's tags where it maps the KV cache, else False."""
            tags = kwargs.get("tags", args[0] if args else None)
            return tags if tags is None or "kv_cache" in tags else False

        def wake_up(original, *args, **kwargs):
            tags = kv_tags(args, kwargs)
            if tags is False:
                return original(*args, **kwargs)
            # the KV cache needs the memory now: what vLLM takes next, from its own
            # allocator (and what the last generation took beyond it): the begin waits
            # only for what the free memory lacks (nothing at a share that fits anyway)
            upcoming = upcoming_bytes(tags, self._share(), gpu_total_bytes(self.options.device),
                                      generation_bytes=self._generation_bytes)
            skipped = self._start("vLLM KV-cache wake-up", memory_needed_now=True,
                                  allocating_bytes=upcoming)
            result = (self._wake_after_skipped_begin(original, args, kwargs) if skipped
                      else original(*args, **kwargs))
            if self._inside_generate and self.session is not None:
                self._at_kv_wake = torch_reserved_bytes(self.options.device)
            return result

        llm = vllm_generation.llm
        self._patches.wrap(llm, "wake_up", wake_up)
        self._patches.wrap(llm, "generate", before=self._starting("vLLM generate"),
                           after=lambda _result, *a, **k: self._generated())

    def _wake_after_skipped_begin(self, original, args, kwargs):
        """Every rank judged that vLLM's KV cache fits and skipped its begin. Where a
        rank's wake-up runs out of memory anyway, every rank learns it in one store
        round and begins, and that rank wakes again: vLLM maps only what is still
        asleep (vllm/device_allocator/cumem.py, ``CuMemAllocator.wake_up`` skips
        woken allocations; the executor keeps the tag asleep until a wake-up
        returns). Every rank reaches the round, whatever its wake-up raised."""
        try:
            result, error = original(*args, **kwargs), None
        except Exception as caught:  # noqa: BLE001 - re-raised below, after the round
            result, error = None, caught
        short = error is not None and is_out_of_memory(error)
        report = self.session.start_if_any_rank_fell_short("vLLM KV-cache wake-up", short)
        if report is not None:
            self._headroom_from = report
        if error is not None and (not short or report is None):
            raise error
        return original(*args, **kwargs) if short else result

    def _generated(self) -> None:
        """vLLM is at its fullest now (cache mapped, activations cached by torch's
        allocator) and sleeps next: what stays free bounds the headroom line, and
        what the generation took beyond its KV wake-up joins the next begin's estimate.
        That take is read from torch's allocator (this process's), not from the free
        memory: where ranks share a GPU, another rank's KV wake-up landing between
        the two readings moves the free memory, and the next begin would suspend for
        nothing."""
        at_wake, self._at_kv_wake = self._at_kv_wake, None
        if not self._inside_generate or self.session is None:
            return
        self._free_at_fullest = self.session.free_here()
        now = torch_reserved_bytes(self.options.device)
        if at_wake is not None and now is not None:
            # the last generation's, not the largest: what a generation allocates
            # stays reserved through vLLM's sleep, so the next one takes only what is
            # new; a larger one shows again
            self._generation_bytes = max(now - at_wake, 0)

    def _hook_server(self, vllm_generation) -> None:
        """Rank 0 suspends right before its request to the server; the other ranks
        when they reach the broadcast of the completions, where everyone resumes."""
        def in_call(original, *args, **kwargs):
            _in_server_call.append(self)
            try:
                return original(*args, **kwargs)
            finally:
                _in_server_call.remove(self)

        self._patches.wrap(vllm_generation, "generate", in_call)
        client = getattr(vllm_generation, "vllm_client", None)  # rank 0 only
        if client is not None:
            request = self._starting("vLLM server request", lambda: self in _in_server_call)
            for name in ("image_features", "generate"):
                self._patches.wrap(client, name, before=request)
        module = sys.modules.get("trl.generation.vllm_generation")
        if module is not None:  # every rank meets at the broadcast of the server's completions
            self._patches.wrap(module, "broadcast_object_list", before=_server_broadcast)

    def _server_broadcast(self) -> None:
        self._start("waiting for the vLLM server")
        self._stop("broadcast of the server's completions")

    # --- metrics ------------------------------------------------------------------
    def _log_with_metrics(self, original, logs, *args, **kwargs):
        # Eval logs are prefixed by the trainer from their first key: leave them alone.
        # metrics() is {} until the policy's first begin set it up (a real one, or inert).
        if (self.log_metrics and isinstance(logs, dict) and logs
                and not str(next(iter(logs))).startswith("eval_")):
            logs.update(self.metrics())
        return original(logs, *args, **kwargs)


def _server_broadcast(*args, **kwargs) -> None:
    for callback in list(_in_server_call):
        callback._server_broadcast()
