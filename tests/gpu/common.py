"""Helpers shared by the real-NCCL scripts in this folder.

Every script runs N ranks on whatever GPUs exist: rank r uses GPU
``LOCAL_RANK % device_count`` (several ranks per GPU need NCCL >= 2.30 and
NCCL_MULTI_RANK_GPU_ENABLE=1, which tests/gpu/run_all.py sets). On a shared
GPU cudaMemGetInfo sees every rank, so memory checks compare the GPU's freed
bytes, read between barriers, with the NCCL bytes of all ranks on it.

CPU mode (``AMEM_GPU_DRIVER_ON_CPU=1``; the older ``AMEM_RELIABILITY_CPU=1``
and ``AMEM_SOAK_CPU=1`` select it too): a check of the scripts themselves,
not a GPU result. CI has no GPU, so without it a rename in the package broke
these scripts unseen (tests/test_gpu_drivers_on_cpu.py runs them this way).
Each helper below keeps its GPU behaviour and, on CPU, answers with:

- gloo instead of NCCL (:func:`process_group_backend`), tensors on the CPU;
- the fake NCCL of tests/fake_nccl behind the policy (:func:`policy_backend`,
  :func:`stand_in_backend`), whose tripwire ends a rank whose collective reaches
  a suspended communicator, as real NCCL does; the scripts' own gloo groups
  (:func:`gloo_group`) stay unmapped, as on a GPU where they have no NCCL
  communicator;
- a stand-in for the few ``torch.cuda`` calls the scripts make themselves
  (:func:`bind_device`): constants, so nothing about device memory is measured.
  The package itself still sees no CUDA (``torch.cuda.is_available()`` is left
  alone), as on any CPU machine;
- device-memory and timing verdicts set aside as "not judged on CPU"
  (:func:`set_aside_on_cpu`): the lines that compute them still run.
"""

from __future__ import annotations

import os
import time
import weakref

CPU_ENV = "AMEM_GPU_DRIVER_ON_CPU"
ON_CPU = any(os.environ.get(name) == "1"
             for name in (CPU_ENV, "AMEM_RELIABILITY_CPU", "AMEM_SOAK_CPU"))
#: the CPU stand-in's device memory, free and total: constants, never a measurement
STAND_IN_MEMORY = (40 << 30, 80 << 30)
NOT_JUDGED_WHY = "not judged on CPU: device memory and time are GPU figures"

_fake = None  # the fake NCCL of this process (CPU mode), made at first use
_gloo_only = weakref.WeakSet()  # the scripts' own gloo groups: no NCCL communicator
_not_judged: dict = {}  # check name -> what it said on CPU

if ON_CPU and os.environ.get("AMEM_TEST_MUTATE"):
    # tests/test_mutations.py: a deliberately broken package, to show that the
    # CPU runs of these scripts fail on it (tests/mutations.py)
    from tests import mutations

    mutations.apply(os.environ[mutations.ENV])


def bind_device() -> int:
    """Make this rank's GPU current; returns its index. On CPU: installs the
    ``torch.cuda`` stand-in first (see the module docstring)."""
    import torch

    from amem_callbacks.tools.launch import local_device

    if ON_CPU:
        _install_cuda_stand_in(torch)
    else:  # before the first communicator, as an adapter does (AMEM_HOST_BACKUP=0: not)
        from amem_callbacks import host_backup

        host_backup.install()
    device = local_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _install_cuda_stand_in(torch) -> None:
    """The calls these scripts (and megatron's engine suspend/resume) make, answered
    on a machine without CUDA; ``is_available`` and ``device_count`` stay torch's."""
    free, total = STAND_IN_MEMORY
    cuda = torch.cuda
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.current_device = lambda: 0
    cuda.mem_get_info = lambda device=None: (free, total)
    cuda.memory_stats = lambda device=None: {"allocated_bytes.all.current": 0,
                                             "reserved_bytes.all.current": 0,
                                             "reserved_bytes.all.peak": 0}
    cuda.reset_peak_memory_stats = lambda device=None: None


#: the torch.distributed backend a GPU script builds its NCCL groups with, when not
#: "nccl": torch 2.15's nccl-lazy, nccl-legacy or nccl2 (tests/gpu/run_all.py records it)
PG_BACKEND_ENV = "AMEM_GPU_PG_BACKEND"


def process_group_backend(gpu: str = "nccl") -> str:
    """The default group's backend: ``gpu`` on a GPU (or what AMEM_GPU_PG_BACKEND names
    in place of "nccl"), gloo on CPU."""
    if ON_CPU:
        return "gloo"
    if gpu == "nccl":
        return os.environ.get(PG_BACKEND_ENV) or gpu
    return gpu


def tensor_device() -> str:
    """Where the scripts' tensors live."""
    return "cpu" if ON_CPU else "cuda"


def policy_device():
    """The ``device=`` a script gives the policy: the current GPU; None on CPU
    (the package sees no CUDA there and would refuse a device index)."""
    if ON_CPU:
        return None
    import torch

    return torch.cuda.current_device()


def gloo_group(**kwargs):
    """``dist.new_group(backend="gloo")``: the scripts' barriers while NCCL groups
    sleep. On CPU every group is gloo: this one is left out of the fake NCCL, so
    the policy keeps it for want of a communicator, as it does on a GPU."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", **kwargs)
    if ON_CPU:
        _gloo_only.add(group)
    return group


def fake_nccl(default_mib: int = 64, backup: tuple = None):
    """CPU mode: this process's fake NCCL (tests/scenarios.py FakeNccl), one
    communicator per group it is asked about except the :func:`gloo_group` ones.
    ``backup`` (entries, bytes), at the first call: its runtime build, whose suspends
    copy to pinned blocks through the stand-in driver, as NCCL's do."""
    global _fake
    if _fake is None:
        from tests.scenarios import FakeNccl

        if backup:
            from tests.fake_nccl import build_driver

            os.environ["FAKE_NCCL_DRIVER"] = build_driver(os.environ.get("AMEM_FAKE_NCCL_DIR"))
        fake = FakeNccl("runtime" if backup else "suspend", default_mib=default_mib,
                        backup=backup)
        mapped = fake.handle_of

        def handle_of(group):
            if group in _gloo_only:
                return None, "a gloo group of the script: no NCCL communicator"
            return mapped(group)

        fake.handle_of = handle_of  # backend() reads the attribute: the policy gets this one
        _fake = fake
    return _fake


def policy_backend(name: str = "nccl"):
    """The ``backend=`` a script gives the policy: ``name`` on a GPU; on CPU the
    fake NCCL's backend, after checking ``name`` is still a backend the package
    takes (the GPU run passes it)."""
    if not ON_CPU:
        return name
    from amem_callbacks.options import OffloadOptions

    OffloadOptions(backend=name)
    return fake_nccl().backend()


def stand_in_backend():
    """A Backend instance for an adapter's ``backend=`` argument: None on a GPU
    (the adapter's own setting counts), the fake NCCL's backend on CPU."""
    return fake_nccl().backend() if ON_CPU else None


def nccl_library():
    """The NCCL torch loaded (None if none); in CPU mode the fake NCCL's library,
    which is the one the policy runs on there (a CUDA torch on a GPU host run in
    CPU mode still loads its own NCCL, measured: that is not the one in use)."""
    if ON_CPU:
        return fake_nccl().library
    from amem_callbacks.nccl_library import NcclLibrary

    return NcclLibrary.loaded()


def comm_handle(group) -> tuple:
    """``(handle, why_not)`` of the group's NCCL communicator, as the nccl backend
    reaches it; on CPU (torch says "no CUDA device") the fake NCCL's."""
    from amem_callbacks.backends.nccl import torch_comm_handle

    handle, why = torch_comm_handle(group)
    if handle is None and ON_CPU:
        handle, why = fake_nccl().handle_of(group)
    return handle, why


def set_aside_on_cpu(checks: dict, *names: str) -> dict:
    """On CPU: move the named checks (device memory, timing) out of ``checks``
    into :func:`cpu_notes`. On a GPU: nothing. Returns ``checks``."""
    if ON_CPU:
        for name in names:
            _not_judged[name] = f"{NOT_JUDGED_WHY} (on CPU it said {checks.pop(name)!r})"
    return checks


def cpu_notes() -> dict:
    """What a script adds to its result on CPU (nothing on a GPU)."""
    if not ON_CPU:
        return {}
    return {"mode": "cpu (gloo, fake NCCL; not a GPU result)",
            "not_judged_on_cpu": dict(_not_judged)}


def ranks_per_gpu() -> int:
    import torch
    import torch.distributed as dist

    return -(-dist.get_world_size() // max(1, torch.cuda.device_count()))


def exact_allreduce(group, value: float, device=None, numel: int = 1 << 20) -> bool:
    """All-reduce ``value * (rank + 1)`` on ``group`` and check the exact sum:
    a wrong or partial result from a half-resumed communicator shows here.
    ``device``: default "cuda" ("cpu" in CPU mode)."""
    import torch
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    t = torch.full((numel,), value * (dist.get_rank() + 1), device=device or tensor_device())
    dist.all_reduce(t, group=group)
    return bool(torch.all(t == value * sum(r + 1 for r in ranks)).item())


def free_bytes() -> int:
    """Free device memory after the queued work has finished."""
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def same_gpu_total(sync, value: int) -> int:
    """Sum of ``value`` over the ranks on this rank's GPU (one GPU: all ranks)."""
    import torch.distributed as dist

    from amem_callbacks.placement import device_id

    mine = device_id(policy_device())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, value), group=sync)
    return sum(v for dev, v in everyone if dev == mine)


class StepTimer:
    """Wall time of each optimizer step of a transformers Trainer (a generation
    included in every ``steps_per_generation``-th), GPU work finished:
    ``synchronize`` is called at both ends (``torch.cuda.synchronize`` on a GPU)."""

    def __init__(self, synchronize):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                synchronize()
                timer.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                synchronize()
                timer.steps.append(time.perf_counter() - timer.start)

        self.steps, self.start, self.callback = [], 0.0, _Callback()


# --- this process's own device memory (NVML) ---------------------------------
# cudaMemGetInfo sees the whole GPU: a soak that shares its GPU with other jobs
# (the test suite beside it, say) would judge their memory as its own. NVML's
# per-process accounting counts this process alone: CUDA context, the caching
# allocator's reserve and NCCL's buffers together. Read through ctypes from the
# driver's own libnvidia-ml (no pynvml on the GPU image); the v2 record layout
# (pid, used bytes, two instance ids) is fixed by NVML's ABI.
NVML_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE for usedGpuMemory
STAND_IN_PROCESS_BYTES = 1 << 30  # CPU mode: a constant, never a measurement


class _Nvml:
    def __init__(self):
        import ctypes

        self.ct = ctypes
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit_v2 failed")

        class ProcessInfo(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong),
                        ("gpu_instance", ctypes.c_uint), ("compute_instance", ctypes.c_uint)]

        self.record = ProcessInfo
        self.handles = {}

    def handle(self, key: tuple):
        """key: torch's (pci_domain_id, pci_bus_id, pci_device_id) of the GPU (ints)."""
        if key not in self.handles:
            handle = self.ct.c_void_p()
            bus = "{:08X}:{:02X}:{:02X}.0".format(*key).encode()
            rc = self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus, self.ct.byref(handle))
            if rc != 0:
                raise OSError(f"nvmlDeviceGetHandleByPciBusId_v2({bus!r}) = {rc}")
            self.handles[key] = handle
        return self.handles[key]

    def used_by(self, key: tuple, pid: int):
        ct, handle = self.ct, self.handle(key)
        count = ct.c_uint(64)
        infos = (self.record * 64)()
        rc = self.lib.nvmlDeviceGetComputeRunningProcesses_v2(handle, ct.byref(count), infos)
        if rc != 0:
            raise OSError(f"nvmlDeviceGetComputeRunningProcesses_v2 = {rc}")
        for info in infos[:count.value]:
            if info.pid == pid:
                return None if info.used == NVML_NOT_AVAILABLE else int(info.used)
        return None  # not listed (a PID namespace NVML does not see into): not measured


_nvml = None


def process_device_bytes():
    """Device bytes this process holds on its current GPU, by NVML's per-process
    count; None where NVML cannot say. CPU mode: a constant stand-in."""
    global _nvml
    if ON_CPU:
        return STAND_IN_PROCESS_BYTES
    import torch

    if _nvml is False:  # NVML did not start here: said once, not retried
        return None
    try:
        if _nvml is None:
            _nvml = _Nvml()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        key = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
        return _nvml.used_by(key, os.getpid())
    except (OSError, AttributeError) as exc:
        if _nvml is None:
            _nvml = False
        print(f"process_device_bytes: not measured ({type(exc).__name__}: {exc})", flush=True)
        return None


def run_commit(root: str = None):
    """The commit a result was made at (tools/provenance.commit), of this tree by default."""
    from amem_callbacks.tools.provenance import commit

    return commit(root or os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))


def unheld_bytes(sync=None) -> tuple:
    """(bytes, measure): the GPU's memory not held by this process. Where NVML
    counts this process (``process_device_bytes``) it is the GPU's total minus
    that count, which other jobs on the GPU (a soak beside the test suite, a
    neighbour's training) do not move; measure ``"process"``. Else cudaMemGetInfo's
    free bytes, which they do; measure ``"gpu"``. ``sync``: a gloo group to
    barrier on first, so every rank reads after the others' transitions."""
    import torch

    torch.cuda.synchronize()
    if sync is not None:
        import torch.distributed as dist

        dist.barrier(group=sync)
    free, total = torch.cuda.mem_get_info()
    own = process_device_bytes()
    return (total - own, "process") if own is not None else (free, "gpu")


# shared with experiments/ (its runs start from the installed package too)
from experiments.gpu_runs import INSTALL_COMMAND, require_installed_package  # noqa: E402,F401


#: the environment that decides what a GPU run measured, kept beside its command
#: (PYTHONPATH: which bundle's wheels, tests/gpu/bundle_*.sh, the code came from)
PROVENANCE_ENV = ("LD_PRELOAD", "NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_BUFFSIZE",
                  "NCCL_MAX_NCHANNELS", "NCCL_NVLS_ENABLE", "AMEM_GPU_QUICK",
                  "CUDA_VISIBLE_DEVICES", "TORCH_DIST_USE_NCCL2", "PYTHONPATH",
                  "PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK", CPU_ENV)
#: the command line of a wrapper that ran this script for the user (tests/gpu/verl_gpu.sh)
RUN_COMMAND_ENV = "AMEM_RUN_COMMAND"


def launcher_command(script: str):
    """The torchrun line this process is a rank of, as typed: torchrun's agent starts
    each rank itself, so under it (TORCHELASTIC_RUN_ID set) the parent's /proc
    cmdline is the command, with its own flags. None elsewhere, or where that
    line does not name ``script`` (a rank started by something else)."""
    import shlex

    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return None
    if not any(a.endswith(script) for a in argv[1:]):
        return None
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":  # the console script
        argv = argv[1:]
    return " ".join([os.path.basename(argv[0]), *map(shlex.quote, argv[1:])])


def provenance(script: str, argv=None) -> dict:
    """What every result records: the commit, the exact command and the environment
    it depends on. The command is the one the user typed: torchrun's for a rank
    under it (:func:`launcher_command`), a wrapper's (``AMEM_RUN_COMMAND``, set by it
    for this process alone), else this interpreter's name, the script as given and
    its arguments. A driver that starts its ranks itself records this in the
    parent, where that command ran."""
    import shlex
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    command = launcher_command(script) or os.environ.get(RUN_COMMAND_ENV) or " ".join(
        [os.path.basename(sys.executable), script, *map(shlex.quote, map(str, args))])
    return {"commit": run_commit(), "command": command,
            "env": {k: os.environ[k] for k in PROVENANCE_ENV if k in os.environ}}


def proc_fields(path: str, keys: tuple) -> dict:
    """Named fields of a /proc file (/proc/self/status, /proc/meminfo): values
    given in kB as bytes, plain counts (Threads) as they are."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in keys:
                parts = rest.split()
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


# --- what every record carries: its code and its machine ---------------------
def commit() -> str:
    """The code a record was made with: AMEM_COMMIT (set by whoever launches the run,
    since a copied working tree may keep stale git metadata), else git's HEAD, with
    "+dirty" when the tree differs from it."""
    import subprocess

    given = os.environ.get("AMEM_COMMIT")
    if given:
        return given
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def machine() -> dict:
    """Card, driver, torch and the NCCL in use (tools/provenance.machine): in CPU mode
    the fake NCCL's library and no card."""
    from amem_callbacks.tools.provenance import machine as record_machine

    return record_machine(nccl_library(), gpu=not ON_CPU)
