"""amem_callbacks.availability: one answer per question, cached only where the
answer cannot change, and never the reason torch gets imported."""

import os
import subprocess
import sys
import textwrap

import pytest

from amem_callbacks import availability
from amem_callbacks.availability import (
    is_cuda_available, is_cuda_initialized, is_distributed_available, is_distributed_initialized,
    is_importable, is_torch_importable, is_torch_loaded, loaded_torch,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh(code: str) -> str:
    """``code``'s stdout in a new interpreter (this one has torch imported)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_every_check_before_torch_is_imported_says_false_and_imports_nothing():
    out = fresh("""
        import sys
        from amem_callbacks import availability as a
        print(a.is_torch_loaded(), a.loaded_torch(), a.is_cuda_available(),
              a.is_cuda_initialized(), a.is_distributed_available(),
              a.is_distributed_initialized())
        print(a.is_torch_importable(), 'torch' in sys.modules)
        from amem_callbacks import memory, headroom
        print(memory.device_free_bytes(), memory.current_device(), memory.empty_cache(),
              headroom.gpu_total_bytes(), memory.torch_reserved_bytes(), 'torch' in sys.modules)
        import torch
        print(a.is_torch_loaded(), a.is_distributed_available(),
              a.is_cuda_available() == torch.cuda.is_available())
    """)
    assert out.splitlines() == ["False None False False False False",
                                "True False",
                                "None None None None None False",
                                "True True True"]


def test_distributed_readiness_is_never_cached():
    """False before init_process_group, True after, False again after destroy:
    a cached False (or True) would have stuck."""
    out = fresh("""
        import os, tempfile
        import torch.distributed as dist
        from amem_callbacks.availability import is_distributed_initialized as ready
        from amem_callbacks.groups import existing_group_names
        seen = [ready(), sorted(existing_group_names())]
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        seen += [ready(), "world" in existing_group_names()]
        dist.destroy_process_group()
        seen += [ready(), sorted(existing_group_names())]
        print(seen)
    """)
    assert out == "[False, [], True, True, False, []]"


@pytest.fixture
def torch_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    return torch.cuda


def test_cuda_answer_is_asked_once_per_probe(torch_cuda, monkeypatch):
    calls = []

    def probe():
        calls.append(1)
        return True

    monkeypatch.setattr(torch_cuda, "is_available", probe)
    assert is_cuda_available() and is_cuda_available() and is_cuda_available()
    assert len(calls) == 1  # torch counts devices once per process: so do we


def test_a_replaced_probe_is_asked_afresh(torch_cuda, monkeypatch):
    """Tests and stand-ins replace torch.cuda.is_available: each replacement answers
    for itself (the cache is keyed by the function, not a global flag)."""
    monkeypatch.setattr(torch_cuda, "is_available", lambda: True)
    assert is_cuda_available()
    monkeypatch.setattr(torch_cuda, "is_available", lambda: False)
    assert not is_cuda_available()
    assert not is_cuda_initialized()


def test_nvml_based_check_is_not_cached(torch_cuda, monkeypatch):
    answers = [False, True]

    def probe():
        return answers.pop(0)

    monkeypatch.setattr(torch_cuda, "is_available", probe)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    assert not is_cuda_available()
    assert is_cuda_available()  # NVML may answer otherwise later: asked each time


def test_cuda_initialized_follows_torch_each_call(torch_cuda, monkeypatch):
    up = []
    monkeypatch.setattr(torch_cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch_cuda, "is_initialized", lambda: bool(up))
    assert not is_cuda_initialized()
    up.append(1)  # the program's first CUDA call
    assert is_cuda_initialized()


def test_a_package_installed_after_a_miss_is_found(tmp_path, monkeypatch):
    """Only True is cached: a False would hide a package installed later."""
    name = "amem_availability_probe_pkg"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not is_importable(name)
    (tmp_path / f"{name}.py").write_text("")
    import importlib

    importlib.invalidate_caches()
    assert is_importable(name)
    assert name not in sys.modules  # found, not imported
    (tmp_path / f"{name}.py").unlink()
    assert is_importable(name)  # found stays found (the cached True)
    availability.cache_clear()
    importlib.invalidate_caches()
    assert not is_importable(name)


def test_a_missing_parent_package_is_not_importable_and_raises_nothing():
    assert not is_importable("amem_no_such_package_xyz.sub")
    assert is_importable("amem_callbacks.availability")


def test_torch_checks_in_this_process():
    torch = pytest.importorskip("torch")
    assert is_torch_loaded() and loaded_torch() is torch and is_torch_importable()
    assert is_distributed_available() is torch.distributed.is_available()
    assert is_distributed_initialized() is torch.distributed.is_initialized()


def test_memory_readings_without_cuda_start_nothing(torch_cuda, monkeypatch):
    from amem_callbacks import headroom, memory

    monkeypatch.setattr(torch_cuda, "is_available", lambda: False)
    assert memory.device_free_bytes() is None and memory.current_device() is None
    assert headroom.gpu_total_bytes() is None and memory.torch_reserved_bytes() is None
    memory.empty_cache()
    with memory.on_device(0):  # no CUDA: no device switch, no error
        pass


def test_torch_reserved_bytes_reads_the_given_device_or_the_current_one(torch_cuda, monkeypatch):
    """The line the TRL adapter runs on a GPU, against torch's own functions faked."""
    from amem_callbacks import memory

    monkeypatch.setattr(memory, "is_cuda_initialized", lambda: True)
    monkeypatch.setattr(torch_cuda, "memory_reserved", lambda device: 1000 + device)
    monkeypatch.setattr(torch_cuda, "current_device", lambda: 3)
    assert memory.torch_reserved_bytes(1) == 1001
    assert memory.torch_reserved_bytes() == 1003


#: Modules that import torch at the top on purpose: each runs only in a rank
#: process or as a command of its own (see their docstrings).
TORCH_AT_THE_TOP = {"amem_callbacks.tools.bench_backup", "amem_callbacks.tools.bench_rank",
                    "amem_callbacks.tools.demo_rank",
                    "amem_callbacks.tools.probe"}


def _modules() -> list:
    names = []
    for folder, _, files in os.walk(os.path.join(ROOT, "amem_callbacks")):
        for file in sorted(files):
            if file.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, file), ROOT)[:-3]
                names.append(path.replace(os.sep, ".").removesuffix(".__init__"))
    return sorted(names)


def test_each_module_imports_alone_and_light():
    """Each module imported first in a new interpreter: an import cycle fails
    here in whichever order it bites; and none but the rank modules brings torch."""
    script = textwrap.dedent("""
        import subprocess, sys
        bad = []
        for name in sys.argv[1:]:
            code = f"import sys, {name}; print('torch' in sys.modules)"
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            bad.append(f"{name}: {run.stdout.strip() or run.stderr.strip().splitlines()[-1]}")
        print("\\n".join(bad))
    """)
    out = subprocess.run([sys.executable, "-c", script, *_modules()], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    lines = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    assert "amem_callbacks.availability" in lines
    wrong = {name: got for name, got in lines.items()
             if got != str(name in TORCH_AT_THE_TOP)}
    assert not wrong, wrong
