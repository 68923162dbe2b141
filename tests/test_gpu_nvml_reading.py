"""tests/gpu/common.process_device_bytes against a stand-in NVML library: the
GPU-only lines (load, init, handle by PCI bus id, per-process list) run here,
so a changed record layout or call fails CI rather than a GPU soak."""

from __future__ import annotations

import ctypes
import os
import types

import pytest

from tests.gpu import common


class FakeNvml:
    """The three NVML calls the reader makes, answering as the driver would."""

    def __init__(self, listed: dict, init_rc: int = 0):
        self.listed, self.init_rc, self.bus_ids = listed, init_rc, []

    def nvmlInit_v2(self):
        return self.init_rc

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus, handle_ref):
        self.bus_ids.append(bus)
        handle_ref._obj.value = 7
        return 0

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle, count_ref, infos):
        assert handle.value == 7 and count_ref._obj.value == len(infos)
        for i, (pid, used) in enumerate(self.listed.items()):
            infos[i].pid, infos[i].used = pid, used
        count_ref._obj.value = len(self.listed)
        return 0


@pytest.fixture
def reader(monkeypatch):
    import torch  # before CDLL is replaced: torch loads its own libraries with it

    def install(fake):
        monkeypatch.setattr(common, "ON_CPU", False)
        monkeypatch.setattr(common, "_nvml", None)
        monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
        props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x19, pci_device_id=0)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        return common.process_device_bytes
    return install


def test_reads_this_process_own_bytes_by_pci_bus_id(reader):
    fake = FakeNvml({1: 5 << 30, os.getpid(): 3 << 30})
    read = reader(fake)
    assert read() == 3 << 30
    assert read() == 3 << 30
    assert fake.bus_ids == [b"00000000:19:00.0"]  # the handle is looked up once


def test_not_listed_or_not_available_is_not_measured(reader):
    assert reader(FakeNvml({1: 5 << 30}))() is None
    assert reader(FakeNvml({os.getpid(): common.NVML_NOT_AVAILABLE}))() is None


def test_nvml_that_does_not_start_is_said_once_and_not_retried(reader, capsys):
    fake = FakeNvml({os.getpid(): 1}, init_rc=9)
    read = reader(fake)
    assert read() is None and read() is None
    assert capsys.readouterr().out.count("not measured") == 1
    assert common._nvml is False


def test_cpu_mode_answers_with_the_stand_in(monkeypatch):
    monkeypatch.setattr(common, "ON_CPU", True)
    assert common.process_device_bytes() == common.STAND_IN_PROCESS_BYTES



@pytest.mark.parametrize("own, expected", [(3 << 30, ((80 << 30) - (3 << 30), "process")),
                                           (None, (40 << 30, "gpu"))])
def test_unheld_bytes_use_this_process_count_where_nvml_gives_one(monkeypatch, own, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 << 30, 80 << 30))
    monkeypatch.setattr(common, "process_device_bytes", lambda: own)
    assert common.unheld_bytes() == expected
