"""The ``--rl-amem-*`` command-line flags, as a Megatron ``extra_args_provider``,
and the one table that turns them into :class:`~amem_callbacks.OffloadOptions`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Callable, Optional

from amem_callbacks.options import BACKEND_CHOICES, OffloadOptions, number_type

from .roles import ALIASES, VALID_KEEP

logger = logging.getLogger("amem_callbacks")

#: Default safety margin left out of the freed bytes that grow the KV cache:
#: the KV buffer is one allocation, and the caching allocator rounds it up.
DEFAULT_KV_MARGIN_GB = 0.25


@dataclasses.dataclass(frozen=True)
class Settings:
    """The flags' values.

    Args:
        enabled: ``--rl-amem-offload-during-rollout``.
        backend: ``--rl-amem-backend``.
        keep: ``--rl-amem-keep-groups``, as role names.
        group_id: ``--rl-amem-group-id`` (AMem's ``ncclSetGroupID``).
        learn_keep: off with ``--rl-amem-no-learn-keep``.
        overlap: off with ``--rl-amem-blocking``: transitions then sit on the
            critical path, as in releases before the overlap existed.
        grow_kv_cache: ``--rl-amem-grow-kv-cache``: every re-allocation of the
            inference KV cache gets the bytes this rollout's begin freed.
        kv_margin_gb: ``--rl-amem-kv-cache-margin-gb``, left out of those bytes.
    """

    enabled: bool = False
    backend: str = "auto"
    keep: tuple = ()
    group_id: Optional[int] = None
    learn_keep: bool = True
    overlap: bool = True
    grow_kv_cache: bool = False
    kv_margin_gb: float = DEFAULT_KV_MARGIN_GB

    def options(self, **extra) -> OffloadOptions:
        """The policy's options: flag -> option through one table (OPTION_TABLE)."""
        given = {option: convert(getattr(self, field)) for field, (option, convert)
                 in OPTION_TABLE.items()}
        given["backend_options"] = self.backend_options()
        return OffloadOptions(**{**given, **extra})

    def backend_options(self) -> dict:
        return {"amem": {"group_id": self.group_id}} if self.group_id is not None else {}


#: Settings field (i.e. flag) -> (OffloadOptions field, conversion). The
#: adapter-only flags (enabled, group_id via backend_options, the KV-cache ones)
#: are not policy options.
OPTION_TABLE = {
    "backend": ("backend", str),
    "keep": ("keep", lambda names: {"rollout": list(names)}),
    "learn_keep": ("learn_keep", bool),
    "overlap": ("overlap", bool),
}


def keep_list(text: str) -> tuple:
    """``"tp,dp"`` -> ``("tp", "dp")``; an unknown name fails with the valid ones."""
    names = tuple(ALIASES.get(n.strip(), n.strip()) for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("give one or more group roles, e.g. dp,world")
    unknown = [n for n in names if n not in VALID_KEEP]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown group role(s) {', '.join(map(repr, unknown))}: choose from "
            f"{', '.join(sorted(VALID_KEEP))}")
    return names


def group_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


gigabytes = number_type("must be a number of GB >= 0", lambda v: v >= 0)


def _define(group) -> None:
    group.add_argument(
        "--rl-amem-offload-during-rollout", action="store_true",
        help="suspend the NCCL communicators of the process groups the rollout leaves idle "
             "while it generates, and resume them for training")
    group.add_argument(
        "--rl-amem-backend", choices=BACKEND_CHOICES, default="auto",
        help="nccl: ncclCommSuspend (NCCL >= 2.29.7); amem: AMem's patched NCCL; noop: dry "
             "run that only reports; auto: nccl, then amem, else leave training unchanged")
    group.add_argument(
        "--rl-amem-keep-groups", type=keep_list, default=(), metavar="NAME[,NAME...]",
        help="parallel_state roles to keep active during rollout besides the ones the "
             "engine uses (e.g. dp,world)")
    group.add_argument(
        "--rl-amem-no-learn-keep", action="store_true",
        help="do not keep a group active in later rollouts after the guard had to resume "
             "it during one (by default such a group stays active from then on)")
    group.add_argument(
        "--rl-amem-blocking", action="store_true",
        help="wait for every suspend and resume where it is issued instead of running them "
             "behind the rollout and the next training step (slower; for debugging)")
    group.add_argument(
        "--rl-amem-grow-kv-cache", action="store_true",
        help="give the inference engine's KV cache the memory this rollout's suspends freed, "
             "every time the engine re-allocates it (--rl-kv-cache-management-mode "
             "recompute; the cache is never re-allocated in persist mode)")
    group.add_argument(
        "--rl-amem-kv-cache-margin-gb", type=gigabytes, default=DEFAULT_KV_MARGIN_GB,
        metavar="GB", help="memory left out of the freed bytes when growing the KV cache "
                           f"(default {DEFAULT_KV_MARGIN_GB})")
    group.add_argument(
        "--rl-amem-group-id", type=group_id, default=None, metavar="N",
        help="AMem only: ncclSetGroupID value, set before the first communicator exists")


def define(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags in their own argument group of ``parser``."""
    _define(parser.add_argument_group(
        title="amem_callbacks", description="free idle NCCL communicator memory during rollout"))
    return parser


def chain(*providers: Callable) -> Callable:
    """One ``extra_args_provider`` that applies ``providers`` in order.

    Example:
        >>> extra_args_provider=chain(add_inference_args, add_args)
    """
    def provider(parser):
        for add in providers:
            parser = add(parser) or parser
        return parser

    return provider


def settings_from_args(args) -> Settings:
    """Settings from a parsed namespace (Megatron's ``get_args()`` or the launcher's)."""
    settings = Settings(
        enabled=bool(getattr(args, "rl_amem_offload_during_rollout", False)),
        backend=getattr(args, "rl_amem_backend", "auto") or "auto",
        keep=tuple(getattr(args, "rl_amem_keep_groups", ()) or ()),
        group_id=getattr(args, "rl_amem_group_id", None),
        learn_keep=not getattr(args, "rl_amem_no_learn_keep", False),
        overlap=not getattr(args, "rl_amem_blocking", False),
        grow_kv_cache=bool(getattr(args, "rl_amem_grow_kv_cache", False)),
        kv_margin_gb=getattr(args, "rl_amem_kv_cache_margin_gb", DEFAULT_KV_MARGIN_GB))
    if settings.group_id is not None and settings.backend not in ("auto", "amem"):
        logger.warning("amem_callbacks: --rl-amem-group-id applies to --rl-amem-backend amem "
                       "(or auto); ignored with backend %r", settings.backend)
        settings = dataclasses.replace(settings, group_id=None)
    if not settings.enabled and settings != dataclasses.replace(Settings(), kv_margin_gb=
                                                                settings.kv_margin_gb):
        logger.warning("amem_callbacks: --rl-amem-* options given without "
                       "--rl-amem-offload-during-rollout: nothing will be offloaded")
    return settings


def launcher_parser() -> argparse.ArgumentParser:
    """The flags alone, for the launcher to take out of a command line."""
    parser = argparse.ArgumentParser(
        prog="python -m amem_callbacks.adapters.megatron", add_help=False, allow_abbrev=False,
        usage="%(prog)s SCRIPT.py|-m MODULE [SCRIPT ARGS and --rl-amem-* flags ...]",
        description="Run a Megatron script with the --rl-amem-* flags and the rollout hooks; "
                    "the flags may stand anywhere among the script's arguments.")
    _define(parser.add_argument_group("amem_callbacks"))
    return parser
