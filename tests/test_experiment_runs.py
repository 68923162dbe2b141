"""experiments/gpu_runs.py's bounded run ends every process it started.

On the GPU machine (2026-12-03) a curve point's ranks ended with os._exit after their
rollout; torchrun starts each rank in a session of its own, so the killpg of the run
missed the servers they had forked, which held 18 GiB each on the GPU, and the next run
ran out of memory. A process in a session of its own, outliving the run's own process,
stands in for them here.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import gpu_runs as megatron_runs  # noqa: E402

LEAVES_A_SERVER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(0.5)
os._exit(0)
"""


def alive(pid: int) -> bool:
    """Read here, not through the module under test: running, not gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_server_left_in_another_session_is_ended_with_the_run(tmp_path):
    pid_file = tmp_path / "server.pid"
    run = megatron_runs.Run("leaves", [sys.executable, "-c", LEAVES_A_SERVER, str(pid_file)],
                            str(tmp_path / "leaves.log"), timeout_s=60,
                            env=dict(os.environ))
    outcome = run.wait()
    server = int(pid_file.read_text())
    assert outcome["rc"] == 0 and outcome["killed_after_exit"] == [server]
    assert not alive(server)


def test_a_run_that_leaves_nothing_says_nothing_and_other_processes_are_left_alone(tmp_path):
    bystander = megatron_runs.subprocess.Popen([sys.executable, "-c",
                                                "import time; time.sleep(30)"])
    try:
        run = megatron_runs.Run("clean", [sys.executable, "-c", "pass"],
                                str(tmp_path / "clean.log"), timeout_s=60,
                                env=dict(os.environ))
        outcome = run.wait()
        assert outcome["rc"] == 0 and "killed_after_exit" not in outcome
        time.sleep(0.2)
        assert alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()
