"""Backends by name; each is imported only when it is asked for."""

from __future__ import annotations

import importlib

from ..errors import BackendUnavailable
from ..log import logger


#: name -> (module, class); ``auto`` tries them in this order, noop last.
BACKENDS = {
    "nccl": ("amem_callbacks.backends.nccl", "NcclBackend"),
    "amem": ("amem_callbacks.backends.amem", "AmemBackend"),
    "noop": ("amem_callbacks.backends.noop", "NoopBackend"),
}
CHOICES = ("auto",) + tuple(BACKENDS)


def validate_backend_name(name) -> None:
    if not isinstance(name, str) or name not in CHOICES:
        raise ValueError(f"unknown backend {name!r}: write one of {', '.join(map(repr, CHOICES))} "
                         "(or pass a Backend instance)")


def backend_class(name: str):
    """The class of a named backend (its module imports no torch)."""
    validate_backend_name(name)
    module_name, class_name = BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(name: str, **options):
    return backend_class(name)(**options)


def select_backend(name, options: dict) -> tuple:
    """Return ``(backend, description, inert)``.

    ``inert`` is True when nothing usable was found and the policy must leave
    training untouched. A named backend that cannot work here degrades the
    same way (fail safe) and the log line says why and how to fix it.
    """
    if name != "auto":
        backend = name if not isinstance(name, str) else create_backend(name, **options.get(name, {}))
        name = backend.name
        try:
            return backend, backend.check(), False
        except BackendUnavailable as exc:
            logger.warning("amem_callbacks: backend %r cannot work here, NCCL memory stays "
                           "allocated and training runs unchanged: %s", name, exc)
            return create_backend("noop"), str(exc), True
    reasons = []
    for candidate in ("nccl", "amem"):
        backend = create_backend(candidate, **options.get(candidate, {}))
        try:
            description = backend.check()
        except BackendUnavailable as exc:
            reasons.append(f"{candidate}: {exc}")
            continue
        logger.info("amem_callbacks: backend 'auto' picked %r: %s", candidate, description)
        return backend, description, False
    reason = "; ".join(reasons)
    logger.warning("amem_callbacks: no backend can free NCCL memory here, training runs "
                   "unchanged. %s", reason)
    return create_backend("noop"), reason, True
