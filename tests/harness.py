"""Runs a scenario in N fresh processes (one per rank) and collects their results.

Each rank is its own interpreter, as under torchrun, so nothing leaks between
scenarios. A scenario that outlives ``timeout`` counts as a hang: every rank is
killed and the test fails saying so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from tests.fake_nccl.tripwire import EXIT_CODE as FAKE_NCCL_EXIT, MARKER as FAKE_NCCL_MARKER
from amem_callbacks.tools.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RankFailure(AssertionError):
    pass


def run_ranks(scenario: str, world: int = 2, timeout: float = 90.0, args: dict = None,
              env: dict = None, expect_ok: bool = True,
              allow_fake_nccl_fatal: bool = False) -> list:
    """Run a scenario on ``world`` ranks; return their result dicts.

    ``scenario`` is a function name in tests.scenarios, or ``module:function``.

    Each result has ``rank``, ``returncode`` and whatever the scenario returned
    (``result``), or ``error`` with the traceback. ``fake_nccl_fatal`` lists
    the fake NCCL's tripwire lines of a rank that issued a collective on a
    suspended communicator (it exited with code 86, as real NCCL would crash).
    Such a rank fails the run even with ``expect_ok=False``, unless
    ``allow_fake_nccl_fatal`` (the mutation check, which expects it).
    """
    out_dir = tempfile.mkdtemp(prefix=f"amem-{scenario.replace(':', '-')}-")
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = dict(os.environ)
        rank_env.update(env or {})
        rank_env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        AMEM_TEST_OUT=out_dir, PYTHONPATH=ROOT + os.pathsep + rank_env.get("PYTHONPATH", ""))
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")
        command = [sys.executable, "-m", "tests.scenarios", scenario, json.dumps(args or {})]
        if os.environ.get("AMEM_TEST_GDB"):  # debugging aid: native stacks of every thread on a crash
            command = ["gdb", "-q", "-batch", "-ex", "handle SIGPIPE nostop noprint", "-ex", "run",
                       "-ex", "thread apply all bt 12", "--args"] + command
        procs.append(subprocess.Popen(
            command,
            cwd=ROOT, env=rank_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    hung = False
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
    if hung:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    results = []
    for rank, proc in enumerate(procs):
        path = os.path.join(out_dir, f"rank{rank}.json")
        data = json.load(open(path)) if os.path.exists(path) else {}
        data.update(rank=rank, returncode=proc.returncode)
        log = open(os.path.join(out_dir, f"rank{rank}.log"), errors="replace").read()
        data["log"] = log[-6000:]  # the tail, for failure messages
        data["log_path"] = os.path.join(out_dir, f"rank{rank}.log")  # the whole log, for checks
        data["fake_nccl_fatal"] = [line for line in log.splitlines()
                                   if line.startswith(FAKE_NCCL_MARKER)]
        results.append(data)
    fatal = "".join(f"rank {r['rank']} (rc={r['returncode']}): {line}\n"
                    for r in results for line in r["fake_nccl_fatal"])
    if fatal:
        fatal = ("a collective reached a suspended fake NCCL communicator (real NCCL "
                 f"crashes there; the rank exited with {FAKE_NCCL_EXIT}):\n" + fatal)
    if hung:
        raise RankFailure(f"scenario {scenario!r} hung past {timeout} s:\n" + fatal
                          + "\n".join(f"--- rank {r['rank']}\n{r['log']}" for r in results))
    if fatal and not allow_fake_nccl_fatal:
        raise RankFailure(f"scenario {scenario!r} failed:\n" + fatal + "\n".join(
            f"--- rank {r['rank']} rc={r['returncode']}\n{r.get('error', '')}\n{r['log']}"
            for r in results if r["fake_nccl_fatal"]))
    if expect_ok:
        bad = [r for r in results if r["returncode"] != 0 or "error" in r]
        if bad:
            raise RankFailure(f"scenario {scenario!r} failed:\n" + fatal + "\n".join(
                f"--- rank {r['rank']} rc={r['returncode']}\n{r.get('error', '')}\n{r['log']}"
                for r in bad))
    return results
