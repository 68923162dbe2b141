"""Backends by name; each is imported only when it is asked for."""

from __future__ import annotations

import importlib

from ..errors import BackendUnavailable, OptionError
from ..log import logger
from ..states import BackendName, backend_name

#: name -> (module, class), one entry per BackendName but "auto"; ``auto`` tries
#: them in this order, noop last. Each module is imported when it is asked for.
BACKENDS = {
    BackendName.NCCL.value: ("amem_callbacks.backends.nccl", "NcclBackend"),
    BackendName.AMEM.value: ("amem_callbacks.backends.amem", "AmemBackend"),
    BackendName.NOOP.value: ("amem_callbacks.backends.noop", "NoopBackend"),
}
assert tuple(BACKENDS) == BackendName.concrete(), "every BackendName but auto has a class"


def backend_class(name: str):
    """The class of a named backend (its module imports no torch); OptionError
    for an unknown name, or for "auto", which stands for no one class."""
    name = backend_name(name)
    if name is BackendName.AUTO:
        raise OptionError("backend 'auto' is not one backend: select_backend('auto', ...) "
                          f"picks one at start-up; name one of {list(BackendName.concrete())} "
                          "here")
    module_name, class_name = BACKENDS[name.value]
    # by name, when asked for: the module of a backend not used is never imported
    return getattr(importlib.import_module(module_name), class_name)


def create_backend(name: str, **options):
    return backend_class(name)(**options)


def select_backend(name, options: dict) -> tuple:
    """Return ``(backend, description, inert)``.

    ``inert`` is True when nothing usable was found and the policy must leave
    training untouched. A named backend that cannot work here degrades the
    same way (fail safe) and the log line says why and how to fix it.
    """
    if name != BackendName.AUTO:
        backend = name if not isinstance(name, str) else create_backend(name, **options.get(name, {}))
        name = backend.name
        try:
            return backend, backend.check(), False
        except BackendUnavailable as exc:
            logger.warning("amem_callbacks: backend %r cannot work here, NCCL memory stays "
                           "allocated and training runs unchanged: %s", name, exc)
            return create_backend("noop"), str(exc), True
    reasons = []
    for candidate in [name for name in BACKENDS if name != BackendName.NOOP]:  # noop: the fallback
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
