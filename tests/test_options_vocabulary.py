"""Backend names and guard modes: one source each (their enum in states.py), one
validator each, raising OptionError that says what to write instead."""

import argparse

import pytest

from amem_callbacks import backends, options
from amem_callbacks.errors import OptionError
from amem_callbacks.options import OffloadOptions
from amem_callbacks.states import BackendName, GuardMode, backend_name, guard_mode
from amem_callbacks.tools.cli import build_parser


def test_every_list_of_names_is_the_enum():
    assert options.BACKEND_CHOICES == BackendName.choices() == (
        "auto", "nccl", "amem", "noop")
    assert options.GUARD_CHOICES == GuardMode.choices() == ("resume", "strict", "off")
    assert tuple(backends.BACKENDS) == BackendName.concrete() == ("nccl", "amem", "noop")


def _choices(command: str) -> tuple:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if "--backend" in a.option_strings)
    return tuple(action.choices)


def test_the_cli_offers_the_enum():
    assert _choices("demo") == BackendName.choices()
    assert _choices("bench") == BackendName.concrete()  # a bench measures one named backend


@pytest.mark.parametrize("word", BackendName.choices())
def test_every_backend_name_passes_both_doors(word):
    assert backend_name(word) is BackendName(word)
    assert OffloadOptions(backend=word).backend == word
    if word != "auto":
        assert backends.backend_class(word).name == word


@pytest.mark.parametrize("bad", ["ncl", "NCCL", "", None, 3, ["nccl"]])
def test_one_backend_validator_for_options_and_the_registry(bad):
    with pytest.raises(OptionError) as by_registry:
        backend_name(bad)
    assert str(by_registry.value) == (f"unknown backend {bad!r}: write one of 'auto', 'nccl', "
                                      "'amem', 'noop' (or pass a Backend instance)")
    if isinstance(bad, str):  # the registry says the same as the options
        with pytest.raises(OptionError) as by_options:
            OffloadOptions(backend=bad)
        with pytest.raises(OptionError) as by_class:
            backends.create_backend(bad)
        assert str(by_options.value) == str(by_class.value) == str(by_registry.value)


def test_an_unknown_backend_is_still_a_value_error():
    """create_backend raised ValueError before: callers catching it still do."""
    with pytest.raises(ValueError, match="unknown backend 'x'"):
        backends.create_backend("x")


def test_auto_names_no_one_class():
    with pytest.raises(OptionError, match=r"'auto' is not one backend.*\['nccl', 'amem', 'noop'\]"):
        backends.backend_class("auto")


def test_backend_options_keys_come_from_the_enum():
    with pytest.raises(OptionError, match=r"unknown backends \['auto'\]: use \['nccl', 'amem', "
                                          r"'noop'\]"):
        OffloadOptions(backend_options={"auto": {}})


@pytest.mark.parametrize("word", GuardMode.choices())
def test_every_guard_mode_passes(word):
    assert guard_mode(word) is GuardMode(word)
    assert OffloadOptions(guard=word).guard == word


@pytest.mark.parametrize("bad", ["loose", "RESUME", "", None, 1])
def test_one_guard_validator(bad):
    with pytest.raises(OptionError) as err:
        guard_mode(bad)
    assert str(err.value) == f"unknown guard mode {bad!r}: write one of ('resume', 'strict', 'off')"
    with pytest.raises(OptionError) as by_options:
        OffloadOptions(guard=bad)
    assert str(by_options.value) == str(err.value)


def test_a_word_is_its_string():
    assert BackendName.NCCL == "nccl" and f"{GuardMode.OFF}" == "off"
    assert BackendName.lookup("amem") is BackendName.AMEM
    assert BackendName.lookup(5) is None and GuardMode.lookup("nccl") is None
