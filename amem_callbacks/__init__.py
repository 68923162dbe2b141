"""Free idle NCCL communicator memory during RL rollout; restore it for training.

Importing this package imports no torch; the public names load on first use.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "OffloadPolicy": "amem_callbacks.policy",
    "OffloadOptions": "amem_callbacks.options",
    "OptionError": "amem_callbacks.errors",
    "RolloutSession": "amem_callbacks.session",
    "TransitionReport": "amem_callbacks.report",
    "GroupReport": "amem_callbacks.report",
    "GroupView": "amem_callbacks.report",
    "name_group": "amem_callbacks.groups",
    "AmemError": "amem_callbacks.errors",
    "AdapterError": "amem_callbacks.errors",
    "BackendUnavailable": "amem_callbacks.errors",
    "SuspendedGroupError": "amem_callbacks.errors",
    "TransitionTimeout": "amem_callbacks.errors",
    "TransitionError": "amem_callbacks.errors",
    "PhaseError": "amem_callbacks.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'amem_callbacks' has no attribute {name!r}")
