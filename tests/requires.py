"""Skip marks for tests that need a framework the GPU image lacks.

The README's test command installs the dev extras (trl, verl, megatron-core,
datasets...). A host without a registry installs the package alone
(``pip install --no-deps -e .``) and those tests must skip, saying what is
missing, rather than fail inside a subprocess. find_spec, not importorskip:
importing megatron.core or trl here would cost seconds at collection.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

EXTRAS_HINT = "installed by the dev extras: pip install -e '.[dev]'"


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


def missing(*names: str) -> list:
    return [name for name in names if not installed(name)]


def needs_modules(*names: str):
    """Skip unless every module is importable, naming the missing ones."""
    absent = missing(*names)
    return pytest.mark.skipif(bool(absent), reason=f"needs {', '.join(absent)} ({EXTRAS_HINT})")


def skip_unless_installed(*names: str) -> None:
    """The same, from inside a fixture or a test."""
    absent = missing(*names)
    if absent:
        pytest.skip(f"needs {', '.join(absent)} ({EXTRAS_HINT})")


def in_git_checkout(path: str) -> bool:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--is-inside-work-tree"],
                              capture_output=True, text=True).stdout.strip() == "true"
    except OSError:  # no git at all
        return False


def in_ci() -> bool:
    """``CI`` is set (.ci/run sets it): the registries are reachable there."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def skip_for_download(why: str) -> None:
    """A test whose input comes from a registry that did not answer: a skip that
    names why on a host without one (a GPU machine), a failure in CI (``CI`` set),
    where the registries are reachable and a skip would hide the test for good."""
    if in_ci():
        pytest.fail(f"{why} (CI is set: a download that fails here is a failure, not a skip)")
    pytest.skip(why)
