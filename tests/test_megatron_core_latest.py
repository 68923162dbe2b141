"""The Megatron tests again on the megatron-core users install (0.19.2), which needs
Python >= 3.12, from the README's one test command.

The suite's own run has the dev extras' megatron-core 0.16.1 wherever its Python is
3.11 (CI's). In CI (``CI`` set, as .ci/run does) or where asked
(``AMEM_TEST_LATEST_MEGATRON=1``), a Python 3.12 environment (pyenv's, or ``python3.12`` on PATH)
gets torch and megatron-core 0.19.2 from the package index, a copy of this tree is
installed into it, and the Megatron test modules run there in one pytest; every one
of them must pass. The environment is kept under ~/.cache between runs.

Not here: Megatron-LM's own ``megatron/rl`` and ``megatron/inference`` (no package
index carries them; ``tests/gpu/bundle_megatron.sh`` takes them from GitHub for the
GPU runs): the test that reads them skips in this run, saying so.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

from tests.requires import in_ci, in_git_checkout, installed, skip_for_download

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON_CORE = "0.19.2"
TORCH = "2.13.0"  # the version the README's set-up installs (a CUDA build on 3.12: runs on CPU)
PINS = [f"torch=={TORCH}", f"megatron-core=={MEGATRON_CORE}", "pytest>=8", "pytest-timeout",
        "setuptools>=68", "numpy"]
VENV = os.path.join(os.path.expanduser("~"), ".cache", "amem-callbacks",
                    f"py312-mcore{MEGATRON_CORE}-torch{TORCH}")
#: the modules that drive megatron-core's own classes (engine, parallel_state,
#: parser, the RL loop's probes); the 0.19.2 wheel's sources are read by
#: test_kv_growth/test_mcore_0192_sources in the suite's own run already
MODULES = ["tests/test_adapter_megatron.py", "tests/test_rollout_gain_plan.py",
           "tests/test_collective_paths.py", "tests/test_capped_generations.py",
           "tests/test_gpu_drivers_on_cpu.py"]
#: in the mixed modules, the Megatron tests alone
SELECT = ("(megatron or mcore or rollout or gain or grow or capped or curve or pairs or records)"
          " and not verl and not trl")


def python312():
    """A Python >= 3.12 interpreter that runs (a pyenv shim may name one it cannot
    start), or None."""
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        root = ""
    candidates = [shutil.which(name) for name in ("python3.12", "python3.13")]
    for pattern in ("3.12.*", "3.13.*"):
        candidates += sorted(glob.glob(os.path.join(root or "/nonexistent", "versions",
                                                    pattern, "bin", "python3")))
    for candidate in filter(None, candidates):
        try:
            ok = subprocess.run([candidate, "-c", "import sys, venv; "
                                 "assert sys.version_info >= (3, 12)"],
                                capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return candidate
    return None


def venv_ready(python: str) -> bool:
    check = ("import importlib.metadata as m; import pytest, torch; "
             f"assert m.version('megatron-core') == {MEGATRON_CORE!r}; "
             f"assert torch.__version__.split('+')[0] == {TORCH!r}")
    return os.path.exists(python) and subprocess.run(
        [python, "-c", check], capture_output=True, timeout=300).returncode == 0


def make_venv(base_python: str) -> str:
    python = os.path.join(VENV, "bin", "python")
    if venv_ready(python):
        return python
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([base_python, "-m", "venv", VENV], check=True, timeout=300)
    install = subprocess.run([python, "-m", "pip", "install", "-q", *PINS],
                             capture_output=True, text=True, timeout=1200)
    if install.returncode != 0:
        shutil.rmtree(VENV, ignore_errors=True)
        why = (install.stderr.strip().splitlines() or ["pip failed"])[-1]
        skip_for_download(f"could not install {' '.join(PINS)} for Python 3.12: {why}")
    return python


def copy_tree(dest: str) -> str:
    """This tree as it is now (tracked and untracked-not-ignored files), so the
    editable install there builds its own extension and never rewrites the one the
    suite's processes have loaded."""
    if in_git_checkout(ROOT):
        listed = subprocess.run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard",
                                 "-z"], capture_output=True, text=True, check=True).stdout
        for path in filter(None, listed.split("\0")):
            source = os.path.join(ROOT, path)
            if os.path.isfile(source):
                os.makedirs(os.path.dirname(os.path.join(dest, path)), exist_ok=True)
                shutil.copy2(source, os.path.join(dest, path))
    else:
        for name in ("amem_callbacks", "adapters", "tests", "experiments", "examples"):
            shutil.copytree(os.path.join(ROOT, name), os.path.join(dest, name),
                            ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        for name in ("pyproject.toml", "setup.py", "README.md"):
            shutil.copy2(os.path.join(ROOT, name), dest)
    return dest


def summary_counts(text: str) -> dict:
    """pytest's last line as counts: {'passed': 113, 'skipped': 4, ...}."""
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", lines[-1])} if lines else {}


#: where the run is not CI: it asks for this, since the venv takes ~5 GB and minutes
OPT_IN = "AMEM_TEST_LATEST_MEGATRON"


@pytest.mark.timeout(2400)
def test_the_megatron_tests_pass_on_megatron_core_0_19_2(tmp_path, capsys):
    if not (in_ci() or os.environ.get(OPT_IN) == "1"):
        pytest.skip(f"the Megatron tests on megatron-core {MEGATRON_CORE} build a Python 3.12 "
                    "venv (~5 GB: torch's CUDA build from PyPI): CI runs them (.ci/run sets "
                    f"CI); {OPT_IN}=1 runs them here")
    if installed("megatron.core"):
        import importlib.metadata

        if importlib.metadata.version("megatron-core") == MEGATRON_CORE:
            pytest.skip(f"this run has megatron-core {MEGATRON_CORE} itself")
    base = python312()
    if base is None:
        why = "no Python 3.12 here (pyenv or python3.12 on PATH): megatron-core 0.19.2 needs it"
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)
    python = make_venv(base)
    tree = copy_tree(str(tmp_path / "tree"))
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "-e", tree], check=True, capture_output=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    run = subprocess.run([python, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                          "-k", SELECT, *MODULES], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=2200)
    counts = summary_counts(run.stdout)
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    with capsys.disabled():  # in CI's log: what ran on 0.19.2
        print(f"\nmegatron-core {MEGATRON_CORE} on {os.path.basename(base)}: {counts}",
              *skips, sep="\n")
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert counts.get("passed", 0) > 0, counts
    # the one test allowed to skip: Megatron-LM's own sources are on GitHub only
    assert all("megatron.rl" in line for line in skips), skips
