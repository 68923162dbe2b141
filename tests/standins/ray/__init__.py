"""Test stand-in for Ray -- NOT Ray (tests/standins, never shipped).

verl 0.9.1 imports ``ray`` when it is imported (class decorators, type
annotations, ``isinstance`` checks) but calls nothing of Ray while its
``ActorRolloutRefWorker`` runs in plain torchrun processes, which is all
``tests/gpu/verl_gpu.py`` does. This package gives those imports what they
read and nothing more:

- ``remote`` returns its class or function unchanged (also as
  ``remote(num_gpus=1)(cls)``);
- ``is_initialized()`` is False, so verl takes its non-Ray branches;
- the types (``ObjectRef``, ``ActorHandle``, ...) are empty classes, so
  ``isinstance`` is False;
- every function that would need a Ray cluster raises ``RuntimeError``.

``USED`` lists the stand-in functions the process called (the GPU script
records it), so a result file shows what verl asked of Ray.
"""

STANDIN = "test stand-in (tests/standins/ray), not Ray"
__version__ = "0+test.standin"
USED: list = []


def _note(name: str) -> None:
    if name not in USED:
        USED.append(name)


def needs_ray(name: str):
    """A function that a Ray cluster would answer: calling it fails loudly."""

    def missing(*args, **kwargs):
        raise RuntimeError(f"ray.{name} was called, but this is the test stand-in for Ray "
                           "(tests/standins/ray): the path under test must not use Ray")

    missing.__name__ = name.rsplit(".", 1)[-1]
    return missing


class ObjectRef:
    """Only for annotations and isinstance checks."""


def remote(*args, **kwargs):
    """``@ray.remote`` and ``ray.remote(**options)(cls)``: the class unchanged."""
    _note("remote")
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda target: target


def is_initialized() -> bool:
    _note("is_initialized")
    return False


for _name in ("init", "shutdown", "get", "put", "wait", "kill", "get_actor",
              "get_runtime_context", "nodes", "available_resources", "cluster_resources"):
    globals()[_name] = needs_ray(_name)
del _name

# Ray's own package imports these on `import ray`; verl reads `ray.actor.ActorHandle` so.
from ray import actor, util  # noqa: E402,F401
