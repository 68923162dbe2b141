"""A framework's own settings (TRL's keyword arguments, verl's config block) turned
into ``OffloadOptions`` keywords through one table, and hydra's configs as plain
containers: what the adapters that read such settings share."""

from __future__ import annotations

from typing import Mapping, Optional

from amem_callbacks.errors import OptionError


def plain(value):
    """An omegaconf DictConfig/ListConfig (hydra's configs) as plain containers;
    anything else unchanged."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf  # optional: only hydra's configs bring omegaconf

        return OmegaConf.to_container(value, resolve=True)
    return value


def valid_keys(table: Mapping) -> str:
    return ", ".join(f"{key} ({description})" for key, (_, description) in table.items())


def check_block(where: str, block: Mapping, table: Mapping) -> None:
    """A config block's keys and value types against ``table`` (key -> (accepted
    types, how a message describes it)); a list must hold group names (non-empty
    strings). Each message names ``where`` and ends with the valid keys."""
    unknown = sorted(str(k) for k in block if k not in table)
    if unknown:
        raise OptionError(f"{where}: unknown key(s) {unknown}; valid keys: {valid_keys(table)}")
    for key, value in block.items():
        types, description = table[key]
        if not isinstance(value, types) or (isinstance(value, (list, tuple)) and not all(
                isinstance(name, str) and name for name in value)):
            raise OptionError(f"{where}.{key} must be {description}, got {value!r}; "
                              f"valid keys: {valid_keys(table)}")


def map_options(source: str, table: Mapping, given: Mapping, fixed: Optional[dict] = None) -> dict:
    """A framework's names to OffloadOptions keywords, through one ``table``
    (framework name -> option name); an unknown name fails listing the valid ones."""
    unknown = sorted(set(given) - set(table))
    if unknown:
        raise OptionError(f"{source}: unknown option(s) {unknown}: write one of {sorted(table)}")
    out = {table[name]: value for name, value in given.items()}
    out.update(fixed or {})
    return out
