"""The ``amem`` block of verl's ``actor_rollout_ref.rollout.custom``, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from amem_callbacks.errors import OptionError
from amem_callbacks.options import OffloadOptions

from ._options_map import check_block, plain, valid_keys
from amem_callbacks.states import BackendName, GuardMode

CONFIG_KEY = "actor_rollout_ref.rollout.custom.amem"


def _either(words: tuple) -> str:
    """('a', 'b', 'c') -> "'a', 'b' or 'c'" (for a message)."""
    quoted = [repr(w) for w in words]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


#: key -> (accepted types, how the message describes it)
OPTIONS = {
    "enable": ((bool,), "true or false"),
    "backend": ((str,), _either(BackendName.choices())),
    "keep": ((list, tuple), "a list of group names, e.g. [world]"),
    "guard": ((str,), _either(GuardMode.choices())),
    "learn_keep": ((bool,), "true or false"),
    "reuse_host_backup": ((bool,), "true or false"),
}
VALID_KEYS = valid_keys(OPTIONS)


@dataclass(frozen=True)
class AmemSettings:
    """The ``amem`` block of ``rollout.custom``, validated."""

    enable: bool = False
    backend: str = "auto"
    keep: tuple = ()
    guard: str = "resume"
    learn_keep: bool = True
    reuse_host_backup: bool = True

    def options(self, **extra):
        """The policy's options: every key but ``enable`` is an OffloadOptions field
        of the same name. Transitions overlap: the worker waits where it must."""
        given = {k: getattr(self, k) for k in OPTIONS if k != "enable"}
        given.update(keep=list(self.keep), overlap=True)
        return OffloadOptions(**{**given, **extra})


def read_settings(custom) -> AmemSettings:
    """The ``amem`` settings in ``custom`` (``actor_rollout_ref.rollout.custom``: a
    dict, a DictConfig or None); off without the block. A bad key, type or choice
    raises OptionError (a ValueError) listing the valid keys; names in ``keep`` are
    checked later, where the groups exist, when the worker builds its policy."""
    custom = plain(custom)
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
    check_block(CONFIG_KEY, block, OPTIONS)
    settings = AmemSettings(**{k: tuple(v) if k == "keep" else v for k, v in block.items()})
    try:  # the options' own checks of the choices; keep names wait for the groups to exist
        settings.options(keep=())
    except ValueError as exc:
        raise OptionError(f"{CONFIG_KEY}: {exc}; valid keys: {VALID_KEYS}") from None
    return settings
