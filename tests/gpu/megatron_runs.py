"""Starting Megatron-LM's RL loop (through ``megatron_rl_gpu.py``) on the GPU
machine, once per run, bounded, several at a time when asked: what the
configuration matrix and the rollout-gain pairs share.

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLE = os.path.join(ROOT, ".gpu", "megatron")
SITE = "/tmp/site-megatron"
WRAPPER = "tests/gpu/megatron_rl_gpu.py"
AMEM_FLAGS = ["--rl-amem-offload-during-rollout", "--rl-amem-backend", "nccl"]


def install_bundle() -> None:
    """The wheels into SITE, and the dataset Makefile train_rl.py's start-up runs."""
    link = os.path.join(ROOT, "amem_callbacks", "adapters")
    if not os.path.exists(link):  # `pip install -e .` maps it; a bare checkout needs the link
        os.symlink(os.path.join("..", "adapters"), link)
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


class Run:
    """One bounded torchrun; ``wait`` returns the outcome as a dict."""

    def __init__(self, name: str, argv: list, log: str, timeout_s: float, env: dict):
        self.name, self.argv, self.log, self.timeout_s = name, argv, log, timeout_s
        self.start = time.monotonic()
        self._log = open(log, "w")
        # A new session: rank 0's servers (coordinator, HTTP) die with the run.
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self) -> dict:
        left = self.timeout_s - (time.monotonic() - self.start)
        try:
            rc = self.proc.wait(max(1.0, left))
            hung = False
        except subprocess.TimeoutExpired:
            rc, hung = None, True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        return {"name": self.name, "rc": rc, "hung": hung,
                "seconds": round(time.monotonic() - self.start, 1),
                "command": " ".join(self.argv), "log": self.log, "tail": tail(self.log)}


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
