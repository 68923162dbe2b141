"""The ``--rl-amem-*`` flags, as a Megatron ``extra_args_provider``: one table
(FLAGS) defines them, reads them back, and names the OffloadOptions field each sets."""

from __future__ import annotations

import argparse
import dataclasses
import operator
from typing import Callable, Mapping, Optional

from amem_callbacks.log import logger
from amem_callbacks.checks import MAX_C_INT, number_type
from amem_callbacks.options import BACKEND_CHOICES, OffloadOptions
from amem_callbacks.states import BackendName

from .roles import ALIASES, VALID_KEEP

def roles_type(valid, aliases: Optional[Mapping] = None) -> Callable[[str], tuple]:
    """An argparse ``type=`` for a comma list of group roles out of ``valid``
    (``aliases``: other spellings of them): ``"tp,dp"`` -> ``("tp", "dp")``; an
    unknown role fails naming the valid ones."""
    aliases = aliases or {}

    def parse(text: str) -> tuple:
        names = tuple(aliases.get(n.strip(), n.strip()) for n in text.split(",") if n.strip())
        if not names:
            raise argparse.ArgumentTypeError("give one or more group roles, e.g. dp,world")
        unknown = [n for n in names if n not in valid]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown group role(s) {', '.join(map(repr, unknown))}: choose from "
                f"{', '.join(sorted(valid))}")
        return names

    return parse


#: Left out of the freed bytes that grow the KV cache: the cache is one
#: allocation, and the caching allocator rounds it up.
DEFAULT_KV_MARGIN_GB = 0.25
#: Every flag of ours starts so; the launcher refuses one it does not define.
PREFIX = "--rl-amem-"
#: A margin above any device's memory (1 PiB) leaves the KV cache as it was.
MAX_MARGIN_GB = 2**20


@dataclasses.dataclass(frozen=True)
class Settings:
    """The flags' values (FLAGS says which flag sets each field)."""

    enabled: bool = False
    backend: str = "auto"
    keep: tuple = ()
    group_id: Optional[int] = None
    learn_keep: bool = True
    overlap: bool = True
    grow_kv_cache: bool = False
    kv_margin_gb: float = DEFAULT_KV_MARGIN_GB
    reuse_host_backup: bool = True

    def options(self, **extra) -> OffloadOptions:
        """The policy's options: the fields FLAGS maps to an option, then ``extra``."""
        given = {option: getattr(self, field) for field, _, option, _ in FLAGS.values() if option}
        given["keep"] = {"rollout": list(self.keep)}
        return OffloadOptions(**{**given, "backend_options": self.backend_options(), **extra})

    def backend_options(self) -> dict:
        return {"amem": {"group_id": self.group_id}} if self.group_id is not None else {}


keep_list = roles_type(VALID_KEEP, ALIASES)
group_id = number_type(f"must be an integer >= 0 and <= {MAX_C_INT} (ncclSetGroupID takes a C "
                       "int)", lambda v: 0 <= v <= MAX_C_INT and v == int(v))
gigabytes = number_type(f"must be a number of GB >= 0 and <= {MAX_MARGIN_GB} (more than any "
                        "device holds)", lambda v: 0 <= v <= MAX_MARGIN_GB)


#: flag -> (Settings field, flag value -> field value, OffloadOptions field or
#: None for the adapter's own, argparse keywords).
FLAGS = {
    "--rl-amem-offload-during-rollout": ("enabled", bool, None, dict(
        action="store_true", help="suspend the NCCL communicators of the process groups the "
        "rollout leaves idle while it generates, and resume them for training")),
    "--rl-amem-backend": ("backend", str, "backend", dict(
        choices=BACKEND_CHOICES, default="auto", help="nccl: ncclCommSuspend (NCCL >= 2.29.7); "
        "amem: AMem's patched NCCL; noop: dry run that only reports; auto: nccl, then amem, "
        "else leave training unchanged")),
    "--rl-amem-keep-groups": ("keep", tuple, "keep", dict(
        type=keep_list, default=(), metavar="NAME[,NAME...]", help="parallel_state roles to "
        "keep active during rollout besides the ones the engine uses (e.g. dp,world)")),
    "--rl-amem-no-learn-keep": ("learn_keep", operator.not_, "learn_keep", dict(
        action="store_true", help="do not keep a group active in later rollouts after the "
        "guard had to resume it during one (by default such a group stays active from then on)")),
    "--rl-amem-blocking": ("overlap", operator.not_, "overlap", dict(
        action="store_true", help="wait for every suspend and resume where it is issued instead "
        "of running them behind the rollout and the next training step (slower; for debugging)")),
    "--rl-amem-grow-kv-cache": ("grow_kv_cache", bool, None, dict(
        action="store_true", help="give the inference engine's KV cache the memory this "
        "rollout's suspends freed, every time the engine re-allocates it "
        "(--rl-kv-cache-management-mode recompute; never re-allocated in persist mode)")),
    "--rl-amem-kv-cache-margin-gb": ("kv_margin_gb", float, None, dict(
        type=gigabytes, default=DEFAULT_KV_MARGIN_GB, metavar="GB", help="memory left out of "
        f"the freed bytes when growing the KV cache (default {DEFAULT_KV_MARGIN_GB})")),
    "--rl-amem-no-host-backup-reuse": ("reuse_host_backup", operator.not_, "reuse_host_backup",
                                       dict(action="store_true", help="let NCCL pin and unpin "
        "its host backup at every suspend and resume, as without the package (by default the "
        "pinned backup is kept from one rollout to the next: transitions several times faster)")),
    "--rl-amem-group-id": ("group_id", int, None, dict(
        type=group_id, default=None, metavar="N",
        help="AMem only: ncclSetGroupID value, set before the first communicator exists")),
}


def host_backup_wanted(argv) -> bool:
    """Whether a command line turns offload on with the backup kept. Read from the raw
    arguments: Megatron calls ``add_args`` before it parses, and its first collectives
    (which start NCCL's runtime) come before anything reads the parsed flags."""
    return "--rl-amem-offload-during-rollout" in argv and \
        "--rl-amem-no-host-backup-reuse" not in argv


def define(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags in their own argument group of ``parser``."""
    group = parser.add_argument_group(
        title="amem_callbacks", description="free idle NCCL communicator memory during rollout")
    for flag, (_, _, _, keywords) in FLAGS.items():
        group.add_argument(flag, **keywords)
    return parser


def chain(*providers: Callable) -> Callable:
    """One ``extra_args_provider`` that applies ``providers`` in order, e.g.
    ``chain(add_inference_args, add_args)``."""
    def provider(parser):
        for add in providers:
            parser = add(parser) or parser
        return parser

    return provider


def settings_from_args(args) -> Settings:
    """Settings from a parsed namespace (Megatron's ``get_args()`` or the launcher's)."""
    given = {}
    for flag, (field, convert, _, _) in FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            given[field] = convert(value)
    settings = Settings(**given)
    amem_capable = (BackendName.AUTO, BackendName.AMEM)  # ncclSetGroupID is AMem's
    if settings.group_id is not None and settings.backend not in amem_capable:
        logger.warning("amem_callbacks: --rl-amem-group-id applies to --rl-amem-backend amem "
                       "(or auto); ignored with backend %r", settings.backend)
        settings = dataclasses.replace(settings, group_id=None)
    if not settings.enabled and settings != Settings(kv_margin_gb=settings.kv_margin_gb):
        logger.warning("amem_callbacks: --rl-amem-* options given without "
                       "--rl-amem-offload-during-rollout: nothing will be offloaded")
    return settings


def launcher_parser() -> argparse.ArgumentParser:
    """The flags alone, for the launcher to take out of a command line."""
    return define(argparse.ArgumentParser(
        prog="python -m amem_callbacks.adapters.megatron", add_help=False, allow_abbrev=False,
        usage="%(prog)s SCRIPT.py|-m MODULE [SCRIPT ARGS and --rl-amem-* flags ...]",
        description="Run a Megatron script with the --rl-amem-* flags and the rollout hooks; "
                    "the flags may stand anywhere among the script's arguments."))
