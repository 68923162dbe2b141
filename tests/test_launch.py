"""How many ranks the tools start on the GPUs there are, and the refusal with its fix."""

import types

import pytest


@pytest.fixture
def one_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def with_nccl(version):
        from amem_callbacks.nccl_library import NcclLibrary, version_string

        lib = types.SimpleNamespace(version=version, version_str=version_string(version))
        monkeypatch.setattr(NcclLibrary, "loaded", classmethod(lambda cls: lib))
    return with_nccl


def test_two_ranks_share_one_gpu_where_nccl_allows_it(one_gpu):
    from amem_callbacks.tools.launch import plan_ranks

    one_gpu((2, 30, 7))
    layout = plan_ranks(None)
    assert (layout.ranks, layout.gpus, layout.ranks_per_gpu) == (2, 1, 2) and layout.on_gpu
    assert layout.env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    assert "shared-GPU figures" in layout.describe()
    assert plan_ranks(8).ranks_per_gpu == 8


def test_an_nccl_that_refuses_says_so_in_one_line_with_the_fix(one_gpu):
    from amem_callbacks.tools.launch import plan_ranks

    one_gpu((2, 29, 7))
    layout = plan_ranks(2)
    assert not layout.on_gpu and "NCCL 2.29.7 refuses" in layout.refused
    assert "pip install -U 'nvidia-nccl-cu13>=2.30.0'" in layout.refused
    assert "\n" not in layout.refused


def test_without_a_gpu_the_tools_run_cpu_ranks(monkeypatch):
    import torch

    from amem_callbacks.tools.launch import plan_ranks

    # what a CUDA torch reports with CUDA_VISIBLE_DEVICES="", and a CPU torch always
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    layout = plan_ranks(None)
    assert layout.gpus == 0 and layout.ranks == 2 and not layout.on_gpu and not layout.refused


def test_free_port_draws_below_the_ephemeral_range_and_binds():
    """Below the range the kernel hands outgoing connections: a store's port is
    not taken by a gloo rank's connection between the draw and torchrun's bind."""
    import socket

    from amem_callbacks.tools import launch

    low = launch._ephemeral_low()
    for _ in range(20):
        port = launch.free_port()
        if low is not None:
            assert low - launch.PORTS_BELOW_EPHEMERAL <= port < low
        with socket.socket() as s:
            s.bind(("", port))


def test_free_port_falls_back_to_the_kernels_choice(monkeypatch, tmp_path):
    import socket

    from amem_callbacks.tools import launch

    monkeypatch.setattr(launch, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert launch._ephemeral_low() is None
    port = launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    (tmp_path / "range").write_text("32768\t60999\n")
    monkeypatch.setattr(launch, "EPHEMERAL_RANGE_FILE", str(tmp_path / "range"))
    monkeypatch.setattr(launch, "_binds", lambda port: False)  # nothing below binds
    assert launch._ephemeral_low() == 32768
    assert launch.free_port(tries=3) > 0
