"""``amem-callbacks doctor``: what this machine offers and what to fix, as text or JSON."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Optional

from .. import __version__
from ..availability import is_cuda_available
from ..backends import select_backend
from ..backends.amem import nccl_version_in_file, torch_built_nccl_version
from ..backends.nccl import suspend_capable_nccl_fix
from ..backends.torch_comms import Path, nccl_classes
from ..headroom import gpu_total_bytes, vllm_headroom
from ..log import logger
from ..nccl_library import SUSPEND_MIN_VERSION, NcclLibrary, loaded_nccl_paths, version_string


@dataclass
class Problem:
    what: str
    fix: str


@dataclass
class Diagnosis:
    facts: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    backend: str = "none"
    backend_reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def diagnose(amem_library: Optional[str] = None, probe: bool = True) -> Diagnosis:
    """Collect facts; every problem comes with the exact fix.

    With ``probe`` and a GPU, one real suspend/resume on a 1-rank communicator
    (in a child process) shows which class torch's "nccl" makes here and which
    path the nccl backend takes on it.
    """
    d = Diagnosis()
    f = d.facts
    f["amem_callbacks"] = __version__
    f["python"] = platform.python_version()
    try:
        import torch  # optional: the doctor says how to install it; the CLI parses without it
    except ImportError:
        d.problems.append(Problem("torch is not installed",
                                  "pip install torch (the CUDA build your framework needs)"))
        return d
    f["torch"] = torch.__version__
    f["torch_cuda"] = torch.version.cuda
    f["cuda_available"] = is_cuda_available()
    f["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if is_cuda_available() else []
    if not torch.version.cuda:
        d.problems.append(Problem("this torch is a CPU-only build: there is no NCCL to suspend",
                                  "install a CUDA build of torch on the GPU machines"))
    _nccl_facts(d, torch)
    _paths(d)
    if amem_library and not os.path.isfile(amem_library):
        # Checked against nothing: its folder would make a fix such as LD_LIBRARY_PATH=/
        d.problems.append(Problem(
            f"--amem-library {amem_library}: no such file",
            "give the path of AMem's patched libnccl.so.2 (the file itself, e.g. "
            "/opt/amem/lib/libnccl.so.2), or leave --amem-library out"))
        d.facts.update(amem_library=amem_library, amem_library_exists=False)
        amem_library = None
    _env_facts(d, amem_library)
    _host_backup_facts(d)
    _pick(d, amem_library)
    if probe and is_cuda_available() and d.backend == "nccl":
        _probe(d)
    return d


def _nccl_facts(d: Diagnosis, torch) -> None:
    f = d.facts
    try:
        built = torch.cuda.nccl.version() if torch.version.cuda else None
    except Exception:
        built = None
    f["nccl_torch_built_with"] = version_string(built) if isinstance(built, tuple) else None
    pin = torch_nccl_pin()
    if pin:
        f["nccl_wheel_pinned_by_torch"] = pin
    f["nccl_wheels_installed"] = installed_nccl_wheels()
    lib = NcclLibrary.loaded()
    paths = loaded_nccl_paths()
    f["nccl_loaded_paths"] = paths
    if lib is None:
        f["nccl_loaded"] = None
        if torch.version.cuda:
            d.problems.append(Problem("torch has not loaded an NCCL library in this process",
                                      suspend_capable_nccl_fix()))
        return
    f["nccl_loaded"] = lib.version_str
    f["nccl_symbols"] = {name: lib.has(name) for name in (
        "ncclCommSuspend", "ncclCommResume", "ncclCommMemStats", "ncclPause", "ncclResume",
        "ncclSetGroupID")}
    f["nccl_in_use"] = lib.path
    others = [p for p in paths if os.path.realpath(p) != os.path.realpath(lib.path)]
    if others:
        f["nccl_also_mapped_unused"] = others
    if not lib.has_suspend or lib.version < SUSPEND_MIN_VERSION:
        pinned = f"; this torch pins {pin}" if pin else ""
        d.problems.append(Problem(
            f"loaded NCCL {lib.version_str} cannot suspend communicators (needs >= "
            f"{version_string(SUSPEND_MIN_VERSION)}{pinned})", suspend_capable_nccl_fix()))


def _env_facts(d: Diagnosis, amem_library: Optional[str]) -> None:
    f = d.facts
    for name in ("NCCL_CUMEM_ENABLE", "AMEM_ENABLE", "NCCL_NVLS_ENABLE", "LD_PRELOAD"):
        f[name] = os.environ.get(name)
    if os.environ.get("NCCL_CUMEM_ENABLE", "").strip() == "0":
        d.problems.append(Problem("NCCL_CUMEM_ENABLE=0: suspend would succeed and free nothing",
                                  "unset NCCL_CUMEM_ENABLE (or set it to 1) before NCCL starts"))
    if "amem" in (os.environ.get("LD_PRELOAD") or "").lower():
        d.problems.append(Problem(
            "an AMem library is in LD_PRELOAD: its constructor runs shells that inherit the "
            "preload, an unbounded chain of processes",
            "remove it from LD_PRELOAD; put its folder first in LD_LIBRARY_PATH instead"))
    if os.environ.get("NCCL_NVLS_ENABLE", "") not in ("0",):
        f["nvls_note"] = "NVLS buffers are not released by suspend (NCCL_NVLS_ENABLE=0 avoids them)"
    if amem_library:
        f["amem_library"] = amem_library
        f["amem_library_exists"] = os.path.exists(amem_library)
        version = nccl_version_in_file(amem_library)
        f["amem_library_nccl"] = version_string(version) if version else None
        built = torch_built_nccl_version()
        if version and built and version[:2] < built[:2]:
            d.problems.append(Problem(
                f"AMem's NCCL {version_string(version)} is older than the NCCL this torch was "
                f"built with ({version_string(built)}): torch cannot run on it",
                "use backend='nccl' with NCCL >= 2.29.7, or a torch built against "
                f"NCCL {version_string(version[:2])}"))


def _host_backup_facts(d: Diagnosis) -> None:
    """Whether the hook that keeps NCCL's host backup is built and would go in (the
    probe, on a GPU, says whether NCCL's runtime takes it)."""
    from .. import host_backup

    path = host_backup.library_path()
    d.facts["host_backup_hook"] = path or "not built"
    if path is None:
        d.problems.append(Problem(
            "the host-backup hook was not built at install: NCCL will pin and unpin its host "
            "backup at every suspend and resume (several times slower)",
            "install a C compiler (gcc) and reinstall amem-callbacks"))
    elif host_backup.switched_off():
        d.facts["host_backup_hook"] += f" ({host_backup.ENV_SWITCH}=0: not used)"
    try:  # how a new block is pinned (registered only for the NCCL releases read)
        d.facts["host_backup_new_blocks"] = host_backup.blocks_asked()
    except ValueError as bad:
        d.problems.append(Problem(str(bad), f"unset {host_backup.ENV_BLOCKS}, or write "
                                            f"{' or '.join(host_backup.BLOCK_KINDS)}"))


def _pick(d: Diagnosis, amem_library: Optional[str]) -> None:
    level = logger.level
    logger.setLevel(logging.ERROR)  # the doctor reports the choice itself
    try:
        options = {"amem": {"library_path": amem_library}} if amem_library else {}
        backend, why, inert = select_backend("auto", options)
    finally:
        logger.setLevel(level)
    d.backend = "none (training runs unchanged)" if inert else backend.name
    d.backend_reason = why


def torch_nccl_pin() -> Optional[str]:
    """The nvidia-nccl requirement in torch's own metadata, e.g. 'nvidia-nccl-cu13==2.30.7'."""
    try:
        requires = metadata.requires("torch") or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        if line.startswith("nvidia-nccl"):
            return line.split(";")[0].replace(" ", "")
    return None


def installed_nccl_wheels() -> dict:
    out = {}
    for name in ("nvidia-nccl-cu12", "nvidia-nccl-cu13"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _paths(d: Diagnosis) -> None:
    """Per NCCL backend class of this torch: the path the nccl backend would take."""
    classes = nccl_classes()
    d.facts["nccl_backend_classes"] = {
        name: (reach.path.value if reach.path else "none") + f" - {reach.why}"
        + (f"; not reached: {reach.unreached_why}" if reach.unreached_why else "")
        for name, reach in classes.items()}
    if any(reach.path is Path.TORCH for reach in classes.values()):
        d.facts["nccl_backend_note"] = (
            "torch-native above: groups of that class go through torch's own suspend(), "
            "which holds the GIL; the probe (on a GPU) shows which class 'nccl' makes here")


def _probe(d: Diagnosis) -> None:
    try:
        run = subprocess.run([sys.executable, "-m", "amem_callbacks.tools.probe"],
                             capture_output=True, text=True, timeout=180)
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {
            "ok": False, "error": f"the probe exited with {run.returncode}: "
                                  f"{run.stderr.strip()[-600:]}"}
    except subprocess.TimeoutExpired:
        result = {"ok": False, "error": "the probe did not finish within 180 s"}
    d.facts["probe"] = result
    if not result.get("ok"):
        d.problems.append(Problem(
            f"a real suspend/resume of a 1-rank communicator failed: {result.get('error')}",
            "run `python -m amem_callbacks.tools.probe` to see the whole output; check that "
            "only one libnccl is loaded (no stray LD_PRELOAD)"))
        d.backend, d.backend_reason = "none (training runs unchanged)", result.get("error", "")
    backup = result.get("host_backup") or {}
    if result.get("ok") and not backup.get("kept"):
        d.problems.append(Problem(
            "NCCL pins and unpins its host backup at every suspend and resume here (the slow "
            f"part of a transition): {backup.get('why_not') or 'the probe did not say why'}",
            "build the package's hook (a C compiler at install: pip install -e . with gcc) and "
            "import the adapter before the first NCCL communicator; AMEM_HOST_BACKUP=0 is the "
            "one way to want this"))
    elif result.get("ok") and not backup.get("reused"):
        d.problems.append(Problem(
            "the host-backup hook is in place but NCCL's second suspend in the probe pinned "
            "new memory instead of reusing the first one's: every suspend here pays the "
            "pinning (the slow part of a transition)",
            "report it with `amem-callbacks doctor --json` (an NCCL whose host allocations "
            "the hook does not recognise); AMEM_HOST_BACKUP=0 turns the hook off"))
    if result.get("path") == "torch-native":
        d.problems.append(Problem(
            f"torch's 'nccl' makes {result.get('class')} here, which gives no communicator "
            "pointer: suspend goes through torch's GIL-holding method",
            "use torch's default 'nccl' backend (on torch 2.14 leave TORCH_DIST_USE_NCCL2 unset)"))


def render(d: Diagnosis) -> str:
    lines = ["amem-callbacks doctor", ""]
    width = max(len(k) for k in d.facts) if d.facts else 0
    for key, value in d.facts.items():
        lines.append(f"  {key.ljust(width)}  {value}")
    lines += ["", f"backend 'auto' would use: {d.backend}", f"  because: {d.backend_reason}"]
    if d.problems:
        lines += ["", "problems:"]
        for p in d.problems:
            lines += [f"  - {p.what}", f"    fix: {p.fix}"]
    else:
        lines += ["", "no problems found"]
    return "\n".join(lines)


HEADROOM_HOW = ("measured at a job's first begin: the log line 'amem_callbacks: headroom: ...' "
                "(verl, TRL with vLLM colocated) and the metric amem/headroom/*; give its freed "
                "GB here with --freed-gb and --vllm-utilization for the same figure. Megatron: "
                "--rl-amem-grow-kv-cache gives the KV cache the freed bytes by itself "
                "(--rl-kv-cache-management-mode recompute).")


def headroom_fact(freed_gb: float, utilization: float, gpu_gb: Optional[float]) -> str:
    total = int(gpu_gb * 2**30) if gpu_gb else gpu_total_bytes()
    if not total:
        return "the GPU's total memory is unknown here: give --gpu-gb"
    result = vllm_headroom("gpu_memory_utilization", utilization, int(freed_gb * 2**30), total)
    return result.line()


def main(as_json: bool = False, amem_library: Optional[str] = None, probe: bool = True,
         headroom: Optional[tuple] = None) -> int:
    """Exit status 1 when ``auto`` would leave training untouched (a launch
    script can gate on it), else 0; ``--json`` keeps every detail."""
    d = diagnose(amem_library, probe)
    d.facts["headroom"] = headroom_fact(*headroom) if headroom else HEADROOM_HOW
    print(json.dumps(d.as_dict(), indent=1, default=str) if as_json else render(d))
    return 1 if d.backend.startswith("none") else 0


if __name__ == "__main__":
    sys.exit(main("--json" in sys.argv))
