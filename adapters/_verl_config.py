"""The ``amem`` block of verl's ``actor_rollout_ref.rollout.custom``, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from amem_callbacks.options import OptionError

CONFIG_KEY = "actor_rollout_ref.rollout.custom.amem"
#: key -> (accepted types, how the message describes it)
OPTIONS = {
    "enable": ((bool,), "true or false"),
    "backend": ((str,), "'auto', 'nccl', 'amem' or 'noop'"),
    "keep": ((list, tuple), "a list of group names, e.g. [world]"),
    "guard": ((str,), "'resume', 'strict' or 'off'"),
    "learn_keep": ((bool,), "true or false"),
}
VALID_KEYS = ", ".join(f"{k} ({d})" for k, (_, d) in OPTIONS.items())


@dataclass(frozen=True)
class AmemSettings:
    """The ``amem`` block of ``rollout.custom``, validated."""

    enable: bool = False
    backend: str = "auto"
    keep: tuple = ()
    guard: str = "resume"
    learn_keep: bool = True

    def options(self, **extra):
        """The policy's options: every key but ``enable`` is an OffloadOptions field
        of the same name. Transitions overlap: the worker waits where it must."""
        from amem_callbacks.options import OffloadOptions

        given = {k: getattr(self, k) for k in OPTIONS if k != "enable"}
        given.update(keep=list(self.keep), overlap=True)
        return OffloadOptions(**{**given, **extra})


def read_settings(custom) -> AmemSettings:
    """The ``amem`` settings in ``rollout.custom``; off when there is no block.

    Group names in ``keep`` are checked later, where the groups exist, when
    the worker builds its policy.

    Args:
        custom: ``actor_rollout_ref.rollout.custom``: a dict, a DictConfig or None.

    Raises:
        ValueError: an unknown key, a wrong type or an unknown choice; the
            message lists the valid keys.

    Example:
        >>> read_settings({"amem": {"enable": True, "keep": ["world"]}}).keep
        ('world',)
    """
    custom = _plain(custom)
    if custom is None:
        return AmemSettings()
    if not isinstance(custom, Mapping):
        raise OptionError(f"actor_rollout_ref.rollout.custom must be a mapping, got {custom!r}")
    block = custom.get("amem")
    if block is None:
        return AmemSettings()
    if not isinstance(block, Mapping):
        raise OptionError(f"{CONFIG_KEY} must be a mapping such as {{enable: true}}, got "
                         f"{block!r}; valid keys: {VALID_KEYS}")
    if "overlap" in block:
        raise OptionError(f"{CONFIG_KEY}.overlap: verl already resumes in the background, from "
                         "the end of rollout (sleep_replicas) to the next training call, and the "
                         "suspend must finish before the KV cache comes back, so there is "
                         f"nothing left to overlap: remove the key; valid keys: {VALID_KEYS}")
    unknown = sorted(str(k) for k in block if k not in OPTIONS)
    if unknown:
        raise OptionError(f"{CONFIG_KEY}: unknown key(s) {unknown}; valid keys: {VALID_KEYS}")
    for key, value in block.items():
        types, description = OPTIONS[key]
        wrong = not isinstance(value, types)
        if key == "keep" and not wrong:
            wrong = not all(isinstance(name, str) and name for name in value)
        if wrong:
            raise OptionError(f"{CONFIG_KEY}.{key} must be {description}, got {value!r}; "
                             f"valid keys: {VALID_KEYS}")
    settings = AmemSettings(**{k: tuple(v) if k == "keep" else v for k, v in block.items()})
    try:  # the options' own checks of the choices; keep names wait for the groups to exist
        settings.options(keep=())
    except ValueError as exc:
        raise OptionError(f"{CONFIG_KEY}: {exc}; valid keys: {VALID_KEYS}") from None
    return settings


def _plain(value):
    """A DictConfig/ListConfig as plain containers; anything else unchanged."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value
