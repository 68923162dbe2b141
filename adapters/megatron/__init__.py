"""Megatron adapter: ``--rl-amem-offload-during-rollout`` and the rollout hooks.

Either run the usual command through the launcher (no change to Megatron)::

    torchrun ... -m amem_callbacks.adapters.megatron train_rl.py ARGS... \\
        --rl-amem-offload-during-rollout [--rl-amem-backend nccl] [--rl-amem-keep-groups dp]

or pass :func:`add_args` as Megatron's ``extra_args_provider``
(``chain(add_inference_args, add_args)`` keeps train_rl.py's own provider).
Importing this package imports neither torch nor Megatron; it registers
``parallel_state``'s role names, so ``keep`` lists may use them.
"""

from amem_callbacks.groups import register_roles

from . import hooks
from .args import Settings, chain, define, settings_from_args
from .hooks import install_hooks, remove_hooks
from .offload import RolloutOffload, write_metrics
from .roles import VALID_KEEP

__all__ = ["RolloutOffload", "Settings", "add_args", "chain", "install", "install_hooks",
           "remove_hooks", "settings_from_args", "write_metrics"]

register_roles(VALID_KEEP)


def install(args=None, *, settings: Settings = None, backend=None, writers=None,
            **policy_options) -> RolloutOffload:
    """Install the rollout hooks with explicit settings (the launcher does this).

    Args:
        args: a parsed namespace with the ``rl_amem_*`` flags.
        settings: use these instead of ``args``.
        backend: a Backend instance instead of the ``--rl-amem-backend`` name.
        writers: ``(tensorboard, wandb)`` instead of Megatron's global writers.
        **policy_options: more ``OffloadPolicy`` keyword arguments.

    Example:
        >>> install(settings=Settings(enabled=True, backend="nccl"))
        >>> engine.resume()   # rollout begins: idle groups suspended
    """
    settings = settings if settings is not None else settings_from_args(args)
    controller = RolloutOffload(settings, backend=backend, writers=writers,
                                policy_options=policy_options)
    hooks.set_controller(controller)
    install_hooks()
    return controller


def add_args(parser):
    """Add the ``--rl-amem-*`` flags to a Megatron argument parser.

    Use it as Megatron's ``extra_args_provider``; it returns the parser, so it
    composes with another provider (see :func:`chain`). It also arranges for
    the rollout hooks to be installed when Megatron's inference engine is
    imported; they do nothing unless ``--rl-amem-offload-during-rollout`` is
    given.

    Example:
        >>> from amem_callbacks.adapters.megatron import add_args, chain
        >>> pretrain(..., extra_args_provider=chain(add_inference_args, add_args))
    """
    define(parser)
    install_hooks()
    return parser


def _from_megatron_args():
    args = hooks.megatron_args()
    if args is None or not hasattr(args, "rl_amem_offload_during_rollout"):
        return None
    return RolloutOffload(settings_from_args(args))


hooks.set_controller_source(_from_megatron_args)
