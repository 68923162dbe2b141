"""Test stand-in (never shipped): a CPU "device platform" for verl 0.9.1.

Only ``tests/gpu/verl_gpu.py --cpu-smoke`` imports it, to run that script's
plumbing (verl's real worker, FSDP2 over gloo, the noop backend) on a machine
without a GPU. verl asks its platform for the device module, the current
device, the collective backend and the like; here every memory and stream
function is a no-op on the CPU. Nothing measured with it says anything about
GPUs.

``install()`` must run before verl first asks for its platform; verl's FSDP
engine is registered for "cuda" only, so it also sets VERL_ENGINE_DEVICE=cuda
(the engine then runs on the device this platform names: the CPU).
"""

from __future__ import annotations

import contextlib
import os
import types

import torch


def _device_module() -> types.ModuleType:
    """What verl calls on ``torch.cuda``, answered for the CPU."""
    m = types.ModuleType("verl_cpu_device")
    zero = lambda *a, **k: 0  # noqa: E731
    nothing = lambda *a, **k: None  # noqa: E731
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(m, name, zero)
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats",
                 "ipc_collect"):
        setattr(m, name, nothing)
    m.current_device = lambda: torch.device("cpu")
    m.device_count = lambda: 1
    m.is_available = lambda: True
    m.is_initialized = lambda: True
    m.mem_get_info = lambda *a: (0, 0)  # unknown: the smoke run reads nothing from it
    m.memory_stats = lambda *a, **k: {}
    m.manual_seed = torch.manual_seed
    m.manual_seed_all = torch.manual_seed
    m.get_rng_state = lambda *a: torch.get_rng_state()
    m.set_rng_state = lambda state, *a: torch.set_rng_state(state)
    m.get_device_name = lambda *a: "cpu"
    m.Stream = getattr(torch.cpu, "Stream", object)
    m.current_stream = lambda *a: torch.cpu.current_stream()
    m.stream = lambda *a: contextlib.nullcontext()
    return m


def install() -> None:
    """Make verl run on the CPU (call before verl looks up its platform)."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import set_platform

    module = _device_module()

    class CpuPlatform(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: module)

        def is_available(self):
            return True

        def current_device(self):
            return torch.device("cpu")

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    set_platform(CpuPlatform())
