"""Starting GPU runs from the installed package, once per run, bounded, several at
a time when asked: what the experiments here and the GPU drivers in tests/gpu
share (Megatron-LM's RL loop through ``tests/gpu/megatron_rl_gpu.py``, started as a
script; the configuration matrix; the rollout-gain pairs; the TRL + vLLM runs' clean-up).

Set-up (once per machine): the megatron-core 0.19.2 wheel and the RL
runtime's wheels from the carried ``.gpu/megatron`` bundle
(``tests/gpu/bundle_megatron.sh``) go to /tmp/site-megatron.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, ".gpu", "megatron")
SITE = "/tmp/site-megatron"
WRAPPER = "tests/gpu/megatron_rl_gpu.py"
AMEM_FLAGS = ["--rl-amem-offload-during-rollout", "--rl-amem-backend", "nccl"]


INSTALL_COMMAND = "python3 -m pip install --no-deps --no-build-isolation -e ."


def require_installed_package() -> None:
    """The GPU scripts run on the installed package, as users do: the top-level
    adapters/ folder is ``amem_callbacks.adapters`` only through the install
    (pyproject's package-dir), never through a link or a module splice here. A
    bare copy of the tree stops with the one command that fixes it (no registry
    needed: the dependencies are the GPU image's)."""
    import importlib.util

    root = ROOT
    try:
        found = importlib.util.find_spec("amem_callbacks.adapters") is not None
    except ImportError:
        found = False
    if not found:
        raise SystemExit("amem_callbacks.adapters does not import: the GPU scripts run on the "
                         f"installed package. From {root}: {INSTALL_COMMAND}")
    import amem_callbacks

    where = os.path.dirname(os.path.dirname(os.path.abspath(amem_callbacks.__file__)))
    if os.path.realpath(where) != os.path.realpath(root):
        raise SystemExit(f"amem_callbacks is imported from {where}, not from this tree ({root}): "
                         f"install this one: cd {root} && {INSTALL_COMMAND}")


def install_bundle() -> None:
    """The wheels into SITE, and the dataset Makefile train_rl.py's start-up runs."""
    require_installed_package()
    marker = os.path.join(SITE, ".installed")
    if os.path.exists(marker):
        return
    wheels = glob.glob(os.path.join(BUNDLE, "wheels", "*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {BUNDLE}/wheels: run tests/gpu/bundle_megatron.sh here "
                         "and carry .gpu/megatron")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", SITE, *wheels],
                   check=True)
    datasets = os.path.join(SITE, "megatron", "core", "datasets")
    shutil.copy(os.path.join(BUNDLE, "datasets.Makefile"), os.path.join(datasets, "Makefile"))
    for helper in glob.glob(os.path.join(datasets, "helpers_cpp*.so")):
        os.utime(helper)  # newer than its source: `make` has nothing to rebuild
    open(marker, "w").close()


def environment(extra: dict = None) -> dict:
    env = dict(os.environ)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    env.update(PYTHONPATH=os.pathsep.join([SITE, ROOT, env.get("PYTHONPATH", "")]),
               NCCL_MULTI_RANK_GPU_ENABLE="1", PYTHONUNBUFFERED="1",
               CUDA_DEVICE_MAX_CONNECTIONS="1", MAKEFLAGS=f"LIBEXT={suffix}")
    env.update(extra or {})
    return env


def command(ranks: int, port: int, prefix: str, work: str, amem: bool, flags: list,
            wrapper_flags: list = ()) -> list:
    """The torchrun line of one run (``amem``: through the package's launcher)."""
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-port", str(port)]
    target = ["-m", "amem_callbacks.adapters.megatron", WRAPPER] if amem else [WRAPPER]
    return (head + target + ["--probe-out", prefix, "--mlm", os.path.join(BUNDLE, "mlm"),
                             "--work", work, *wrapper_flags, *(AMEM_FLAGS if amem else ()),
                             *flags])


#: what a run that ran out of device memory logs (torch's message); such a run is
#: stopped once it is seen: the old control logged it and then never exited
OOM = "out of memory"
OOM_MARKS = ("CUDA out of memory", "torch.OutOfMemoryError")


class Run:
    """One bounded torchrun; ``wait`` returns the outcome as a dict. It is stopped
    ``grace_s`` after its log first says a rank ran out of device memory (the other
    rank has then logged its own failure, or waits in a collective for ever)."""

    def __init__(self, name: str, argv: list, log: str, timeout_s: float, env: dict,
                 grace_s: float = 10.0, poll_s: float = 1.0):
        self.name, self.argv, self.log, self.timeout_s = name, argv, log, timeout_s
        self.grace_s, self.poll_s = grace_s, poll_s
        self.start = time.monotonic()
        self._log = open(log, "w")
        # Every process of the run carries this tag in its environment: torchrun starts
        # each rank in a session of its own, and a rank that ends with os._exit leaves
        # its forked servers running (measured: a curve point's two left 18 GiB each on
        # the GPU, and the next run ran out of memory), out of reach of killpg.
        self.tag = f"{name}-{os.getpid()}-{time.time_ns()}"
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**env, RUN_TAG: self.tag},
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self) -> dict:
        deadline, stop_at, stopped, read = self.start + self.timeout_s, None, None, 0
        while True:
            rc = self.proc.poll()
            now = time.monotonic()
            if rc is not None:
                hung = False
                break
            if now >= deadline or (stop_at is not None and now >= stop_at):
                rc, hung = None, stop_at is None
                break
            if stop_at is None:
                read, seen = _scan(self.log, read, OOM_MARKS)
                if seen:
                    stopped, stop_at = OOM, now + self.grace_s
            time.sleep(min(self.poll_s, max(0.0, deadline - now)))
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        left = kill_tagged(self.tag)
        self._log.close()
        outcome = {"name": self.name, "rc": rc, "hung": hung,
                   "seconds": round(time.monotonic() - self.start, 1),
                   "command": " ".join(self.argv), "log": self.log, "tail": tail(self.log)}
        if stopped:
            outcome["stopped"] = stopped
        if left:
            outcome["killed_after_exit"] = left
        return outcome


RUN_TAG = "AMEM_EXPERIMENT_RUN"


def tagged(tag: str) -> list:
    """The pids whose environment holds ``RUN_TAG=tag`` (this user's processes)."""
    needle = f"{RUN_TAG}={tag}".encode() + b"\0"
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    out.append(int(entry))
        except OSError:  # gone, or not ours to read
            pass
    return out


def kill_tagged(tag: str, wait_s: float = 15.0) -> list:
    """SIGKILL every process of the run still alive, and wait until they are gone
    (their device memory is free only then); returns the pids it found."""
    found = tagged(tag)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while not all(map(ended, found)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def ended(pid: int) -> bool:
    """Gone, or a zombie: its memory and files (the GPU's among them) are released. A
    killed process's environment reads empty while it still exits, so ``tagged`` no
    longer finds it before that (measured on CI under load)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _scan(path: str, offset: int, marks: tuple) -> tuple:
    """(new offset, whether the log's text from ``offset`` on holds one of ``marks``);
    reads back a little so a mark cut by the last read is still found."""
    start = max(0, offset - 64)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except OSError:
        return offset, False
    return start + len(data), any(mark.encode() in data for mark in marks)


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def load_records(prefix: str) -> dict:
    """rank -> the JSON each rank wrote (``PREFIX.rankN.json``)."""
    out = {}
    for path in glob.glob(prefix + ".rank*.json"):
        with open(path) as f:
            data = json.load(f)
        out[data.get("rank", len(out))] = data
    return out


def load_json(path: str):
    """A record's JSON, or None where it is missing or cut short (a run killed mid-write):
    the summaries name such a record as missing rather than stop on it."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
