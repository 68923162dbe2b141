"""Megatron adapter: ``--rl-amem-offload-during-rollout`` and the rollout hooks (docs/megatron.md).
Importing it imports neither torch nor Megatron; it registers ``parallel_state``'s role names."""

import sys

from amem_callbacks import host_backup
from amem_callbacks.groups import register_roles

from . import hooks
from .args import Settings, chain, define, host_backup_wanted, settings_from_args
from .hooks import install_hooks, remove_hooks
from .offload import RolloutOffload, write_metrics
from .roles import VALID_KEEP

__all__ = ["RolloutOffload", "Settings", "add_args", "chain", "install", "install_hooks",
           "remove_hooks", "settings_from_args", "write_metrics"]

register_roles(VALID_KEEP)


def install(args=None, *, settings: Settings = None, backend=None, writers=None,
            **policy_options) -> RolloutOffload:
    """Install the rollout hooks with ``settings`` (or those of a namespace ``args``
    holding the flags); the launcher does this. The rest: as :class:`RolloutOffload`."""
    settings = settings if settings is not None else settings_from_args(args)
    controller = RolloutOffload(settings, backend=backend, writers=writers,
                                policy_options=policy_options)
    hooks.set_controller(controller)
    install_hooks()
    return controller


def add_args(parser):
    """Megatron's ``extra_args_provider``: adds the ``--rl-amem-*`` flags and arranges
    for the rollout hooks to be installed when Megatron's engine is imported (they
    read the flags from Megatron's args and do nothing without the first one)."""
    define(parser)
    install_hooks()
    if host_backup_wanted(sys.argv):
        host_backup.install()
    return parser
