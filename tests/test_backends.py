"""Backends against the stand-in NCCL library: checks, fixes, result codes."""

import logging
import os
import subprocess
import sys

import pytest

from amem_callbacks.backends import select_backend
from amem_callbacks.backends.amem import AmemBackend
from amem_callbacks.backends.nccl import NcclBackend, handle_for
from amem_callbacks.errors import BackendUnavailable, NcclError
from amem_callbacks.nccl_library import NcclLibrary, version_tuple
from tests.fake_nccl import FakeControls, build

MiB = 2**20


def _cuda_torch() -> bool:
    import torch

    return torch.version.cuda is not None


# A CUDA torch maps its NCCL when imported, so "auto" finds one there: the
# no-NCCL path can only be shown on a CPU torch.
cpu_torch_only = pytest.mark.skipif(_cuda_torch(), reason="a CUDA torch loads NCCL on import: "
                                                          "the no-NCCL path needs a CPU torch")


@pytest.fixture
def lib(fake_nccl_dir):
    return NcclLibrary.open(build("suspend", fake_nccl_dir))


def test_library_binds_the_table_and_reports_versions(lib, fake_nccl_dir):
    assert lib.version == (2, 32, 3) and lib.version_str == "2.32.3" and lib.has_suspend
    old = NcclLibrary.open(build("old", fake_nccl_dir))
    assert old.version == (2, 28, 9) and not old.has_suspend
    assert version_tuple(2804) == (2, 8, 4) and version_tuple(22907) == (2, 29, 7)


def test_result_codes_become_errors_with_nccls_own_text(lib):
    controls = FakeControls(lib.path)
    comm = controls.create(100 * MiB)
    lib.comm_suspend(comm)
    with pytest.raises(NcclError, match="ncclCommSuspend failed: invalid usage .*ncclResult_t 5"):
        lib.comm_suspend(comm)
    lib.comm_resume(comm)
    with pytest.raises(NcclError, match="ncclCommResume failed: invalid usage"):
        lib.comm_resume(comm)


def test_nccl_backend_reads_stats_and_moves_state(lib):
    comm = FakeControls(lib.path).create(480 * MiB, 4 * MiB)
    backend = NcclBackend(library=lib, handle_of=lambda g: (comm, None))
    assert "NCCL 2.32.3" in backend.check()
    memory = backend.memory(comm)
    assert (memory.suspendable, memory.persist, memory.total) == (480 * MiB, 4 * MiB, 484 * MiB)
    backend.suspend(comm)
    assert backend.memory(comm).suspended
    backend.resume(comm)
    assert not backend.memory(comm).suspended


def test_old_nccl_is_refused_with_the_pip_fix(fake_nccl_dir):
    backend = NcclBackend(library=NcclLibrary.open(build("old", fake_nccl_dir)))
    with pytest.raises(BackendUnavailable) as err:
        backend.check()
    assert "2.28.9" in str(err.value) and "needs NCCL >= 2.29.7" in str(err.value)
    assert "pip install -U 'nvidia-nccl-cu" in err.value.fix


def test_cumem_off_is_refused_because_it_frees_nothing(lib, monkeypatch):
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    with pytest.raises(BackendUnavailable, match="NCCL_CUMEM_ENABLE=0"):
        NcclBackend(library=lib).check()


def test_torch_native_methods_are_used_only_where_torch_gives_no_pointer(lib):
    calls = []

    class ProcessGroupNCCL2:  # torch 2.14's opt-in nccl2: methods, no _comm_ptr
        def suspend(self):
            calls.append("suspend")

        def resume(self):
            calls.append("resume")

        def memory_stats(self):
            return {"suspend": 5, "persist": 1, "total": 6, "suspended": 1}

    backend = NcclBackend(library=lib)
    handle, why = handle_for(ProcessGroupNCCL2())
    assert why is None and backend.holds_gil(handle) and backend.path_of(handle) == "torch-native"
    backend.suspend(handle)
    backend.resume(handle)
    assert calls == ["suspend", "resume"]
    memory = backend.memory(handle)
    assert (memory.suspendable, memory.persist, memory.total, memory.suspended) == (5, 1, 6, True)


def test_amem_needs_its_env_and_its_library_as_the_loaded_nccl(fake_nccl_dir, monkeypatch):
    amem = NcclLibrary.open(build("amem", fake_nccl_dir))
    monkeypatch.delenv("AMEM_ENABLE", raising=False)
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    with pytest.raises(BackendUnavailable, match="AMEM_ENABLE=1") as err:
        AmemBackend(library=amem).check()
    assert "export NCCL_CUMEM_ENABLE=1 AMEM_ENABLE=1" in err.value.fix
    monkeypatch.setenv("AMEM_ENABLE", "1")
    assert "process-wide" in AmemBackend(library=amem, group_id=3).check()
    plain = NcclLibrary.open(build("suspend", fake_nccl_dir))
    with pytest.raises(BackendUnavailable, match="is not AMem's"):
        AmemBackend(library=plain).check()


def test_amem_library_that_is_not_loaded_explains_the_version_gap(fake_nccl_dir, monkeypatch):
    import amem_callbacks.backends.amem as amem_module

    monkeypatch.setattr(amem_module, "torch_built_nccl_version", lambda: (2, 28, 9))
    path = build("amem", fake_nccl_dir)
    plain = NcclLibrary.open(build("suspend", fake_nccl_dir))
    with pytest.raises(BackendUnavailable) as err:
        AmemBackend(library_path=path, library=plain).check()
    text = str(err.value)
    assert "is not the NCCL torch loaded" in text and "patched NCCL 2.27.5" in text
    assert "never put AMem in LD_PRELOAD" in err.value.fix


@cpu_torch_only
def test_auto_without_nccl_is_inert_with_one_warning_line():
    # A fresh process: this one has stand-in libraries mapped.
    code = ("import logging; logging.basicConfig(level=logging.INFO);"
            "from amem_callbacks.backends import select_backend;"
            "b, why, inert = select_backend('auto', {}); print(inert, b.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "noop"]
    lines = [line for line in out.stderr.splitlines() if "amem_callbacks" in line]
    assert len(lines) == 1 and "training runs unchanged" in lines[0], out.stderr
    assert "no NCCL library is loaded" in lines[0] and "pip install" in lines[0]


def test_a_named_backend_that_cannot_work_degrades_to_unchanged_training(caplog, monkeypatch):
    # cuMem off makes "nccl" unusable on any machine, a GPU one with a suspend-capable NCCL too
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")
    with caplog.at_level(logging.WARNING, logger="amem_callbacks"):
        backend, why, inert = select_backend("nccl", {})
    assert inert and "cannot work here" in caplog.records[-1].getMessage()


def test_loaded_finds_the_preloaded_copy_and_never_loads_one(fake_nccl_dir):
    path = build("suspend", fake_nccl_dir)
    code = ("from amem_callbacks.nccl_library import NcclLibrary; import sys;"
            "lib = NcclLibrary.loaded(); print(lib.path if lib else None)")
    with_preload = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  env=dict(os.environ, LD_PRELOAD=path), check=True)
    assert with_preload.stdout.strip() == os.path.realpath(path)
    no_preload = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # a GPU host's own
    without = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=no_preload, check=True)
    assert without.stdout.strip() == "None"
