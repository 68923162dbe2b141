"""The GPU drivers of tests/gpu, their own code, run on CPU.

CI has no GPU, so a rename in the package once broke tests/gpu/core_gpu.py on
every GPU host unseen. Here each driver runs in the CPU mode of
tests/gpu/common.py (``AMEM_GPU_DRIVER_ON_CPU=1``: gloo, the fake NCCL of
tests/fake_nccl behind the policy, a stand-in for the driver's own
``torch.cuda`` calls) far enough to execute every line that touches the
package: policy or adapter construction, begin, the checks that read reports,
views and counters, end, and the JSON it writes. Device-memory and timing
verdicts are listed by the drivers as not judged on CPU; the tests below check
that exactly those are, so a check cannot drop out of the CPU run unnoticed.

What cannot run here, and what stands in:
- megatron_rl_gpu.py's loop needs Megatron-LM's tree (``megatron.rl``,
  train_rl.py), which CI does not have: its record of what the controller did
  (``amem_summary``, ``write_record``) is taken from a live controller on the
  hooked engine of megatron-core 0.16.1, and its ``merge`` (and
  megatron_matrix.py's ``summarise``) read that record beside the recorded GPU
  runs of results/one_h200/megatron_rl_dp2;
- megatron_rl_agent.py imports ``megatron.rl`` and calls nothing of the package;
- verl_gpu.sh repeats verl_gpu.py three times (one amem run runs every line of
  it that touches the package) and merges JSON;
- the launchers' ``--rl-amem-*`` flags are checked against the adapter's parser.

Two CPU cores: every run below is started at once, when the first test of the
module needs them, and each test waits for its own. Most of the time is start-up
(torch, trl, verl and megatron imports) and the reliability cases' bounded waits
for dead or stopped ranks, which overlap well.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from amem_callbacks.tools.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.gpu import common  # noqa: E402
from tests.requires import missing, needs_modules  # noqa: E402

RECORDED_MEGATRON = os.path.join(ROOT, "results", "one_h200", "megatron_rl_dp2")
LIMIT_S = 600  # per run; a hang fails its test, saying so
# a test gives up on its run this long after it began waiting, inside pytest-timeout's
# 300 s (pyproject.toml), so the failure carries every log's tail rather than a bare timeout
WAIT_S = 270
GRACE_S = 20  # after one rank failed, its peers wait for it in a collective: then killed


# --- starting a driver the way its usage line does -------------------------

def driver_env(**extra) -> dict:
    """The CPU mode, on any machine: CUDA hidden so a GPU host runs the same as CI,
    one OpenMP thread per process (dozens of processes share two cores)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               AMEM_GPU_QUICK="1", **{common.CPU_ENV: "1"})
    env.pop("AMEM_TEST_MUTATE", None)  # unmutated unless asked (tests/test_mutations.py)
    # a GPU host preloads a real NCCL (LD_PRELOAD): the CPU mode must load the fake one
    env.pop("LD_PRELOAD", None)
    env.update(extra)
    return env


class Run:
    """Processes started for one driver: ``ranks`` of them with torchrun's
    variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*), or one driver process
    that starts its own ranks."""

    def __init__(self, name: str, argv: list, out: str, ranks: int = 0, env: dict = None):
        self.name, self.out, self.started = name, out, time.monotonic()
        os.makedirs(out, exist_ok=True)
        env = env or driver_env()
        port = free_port()
        self.procs, self.logs = [], []
        for rank in range(max(1, ranks)):
            rank_env = dict(env)
            if ranks:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                                LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = os.path.join(out, f"{name}.{rank}.log")
            self.logs.append(log)
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen([sys.executable, *argv], cwd=ROOT,
                                                   env=rank_env, stdout=f,
                                                   stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        self.codes = None
        self.hung = False

    def wait(self) -> list:
        """Exit codes; a process still running past LIMIT_S, or GRACE_S after
        another failed, is killed with its process group."""
        if self.codes is not None:
            return self.codes
        failed_at, began = None, time.monotonic()
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in self.procs):
                failed_at = now
            hung = now - self.started > LIMIT_S or now - began > WAIT_S
            if hung or (failed_at and now - failed_at > GRACE_S):
                self.hung = hung
                self.kill()
                break
            time.sleep(0.2)
        self.codes = [p.wait() for p in self.procs]  # a killed one: -9
        return self.codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the driver and the ranks it started
                except ProcessLookupError:
                    pass

    def output(self) -> str:
        """Every log's tail, and the result files of rank scenarios (their tracebacks)."""
        files = self.logs + sorted(glob.glob(os.path.join(self.out, "rank*.json")))
        return "\n".join(f"--- {path}\n" + open(path, errors="replace").read()[-6000:]
                         for path in files)

    def passed(self) -> None:
        """Every process exited 0, else the failure with every log tail."""
        codes = self.wait()
        assert not self.hung, (f"{self.name} still ran {time.monotonic() - self.started:.0f} s "
                               f"after it started\n{self.output()}")
        assert codes == [0] * len(codes), f"{self.name} exit codes {codes}\n{self.output()}"

    def json(self, name: str) -> dict:
        with open(os.path.join(self.out, name)) as f:
            return json.load(f)


def gpu_script(name: str) -> str:
    return os.path.join("tests", "gpu", name)


def start_core(out: str, mutation: str = None) -> Run:
    """core_gpu.py on 2 ranks, 3 cycles (also tests/test_mutations.py's run)."""
    env = driver_env(**({"AMEM_TEST_MUTATE": mutation} if mutation else {}))
    return Run("core", [gpu_script("core_gpu.py"), os.path.join(out, "core.json"), "3"], out,
               ranks=2, env=env)


# The reliability cases in three driver runs side by side: the last two spend
# most of their time waiting on purpose (a killed, stopped or dead rank, the
# bounds that come after) while the first computes. Together they are every
# case the CPU mode has (checked below).
RELIABILITY = {
    "reliability": ["interleavings", "disagreement", "host_cap", "ddp_identical", "cycles",
                    "cumem_off"],
    "reliability_faults_a": ["kill_in_suspend", "stop_in_begin"],
    "reliability_faults_b": ["kill_in_resume", "rank_dies", "refused_on_one_rank"],
}
RELIABILITY_GPU_ONLY = {"old_nccl": "needs torch's own older NCCL loaded (no preload)",
                        "amem_unusable": "needs the real NCCL of a CUDA torch to tell AMem's "
                                         "from it"}
MEGATRON_RL_ROLLOUTS = 4  # as many as the recorded amem run had (its merge compares them)


def start_all(names, tmp: str) -> dict:
    starters = {
        "core": lambda out: start_core(out),
        "cold_host": lambda out: Run("cold_host", [gpu_script("cold_host_gpu.py"),
                                                   os.path.join(out, "cold.json"),
                                                   "--groups", "3", "--cycles", "2"], out,
                                     ranks=2),
        "host_backup": lambda out: Run("host_backup", [gpu_script("host_backup_gpu.py"),
                                                       os.path.join(out, "hb.json"),
                                                       "--cycles", "30", "--groups", "2"],
                                       out, ranks=2),
        "suspend_stall": lambda out: Run("suspend_stall", [gpu_script("suspend_stall_gpu.py"),
                                                           os.path.join(out, "stall.json"), "1"],
                                         out, ranks=2),
        "pin_paths": lambda out: Run("pin_paths", [gpu_script("pin_paths_gpu.py"),
                                                   os.path.join(out, "pin.json"), "0.02", "4",
                                                   "1"], out),
        # 4 ranks (TP 2 x PP 2, DP groups of one) rather than the GPU run's 8: the
        # same lines of the package, half the processes on two cores
        "multinode": lambda out: Run("multinode", [gpu_script("multinode_gpu.py"),
                                                   os.path.join(out, "multinode.json"),
                                                   "--ranks", "4"], out),
        **{name: (lambda out, cases=cases, name=name: Run(
            name, [gpu_script("reliability_gpu.py"), os.path.join(out, f"{name}.json"),
                   *cases], out)) for name, cases in RELIABILITY.items()},
        # the shared CPU mode alone (no --cpu): soak's own CPU mode must follow it
        "soak": lambda out: Run("soak", [gpu_script("soak_gpu.py"), "--out",
                                         os.path.join(out, "soak.json"), "--ranks", "2",
                                         "--cycles", "14", "--sample-every", "1",
                                         "--guard-every", "5", "--disagree-every", "10",
                                         "--seconds", "120", "--shared-gpu", "--no-plot"],
                                        out),
        "trl": lambda out: Run("trl", [gpu_script("trl_gpu.py"), os.path.join(out, "trl.json"),
                                       "--steps", "2", "--hidden", "64", "--layers", "1",
                                       "--completion-length", "8", "--batch", "2"], out,
                               ranks=2),
        "verl": lambda out: Run("verl", [gpu_script("verl_gpu.py"),
                                         os.path.join(out, "verl.json"), "--steps", "2"], out,
                                ranks=2),
        # one configuration: dp2 and tp2 run the same lines of the package
        "megatron": lambda out: Run("megatron", [gpu_script("megatron_gpu.py"), out,
                                                 "--configs", "separate"], out,
                                    env=driver_env(PET_MASTER_PORT=str(free_port()))),
        "megatron_rl_records": lambda out: Run(
            "megatron_rl_records",
            ["-m", "tests.scenarios", f"{__name__}:megatron_rl_records",
             json.dumps({"prefix": os.path.join(out, "amem"),
                         "rollouts": MEGATRON_RL_ROLLOUTS})],
            out, ranks=2, env=driver_env(AMEM_TEST_OUT=out)),
    }
    return {name: starters[name](os.path.join(tmp, name)) for name in starters if name in names}


# the frameworks a run's driver imports: without them (a GPU image with no registry,
# the package installed alone) the run is not started and its tests skip, saying so
RUN_NEEDS = {"trl": ("trl", "datasets"), "verl": ("verl",), "megatron": ("megatron.core",),
             "megatron_rl_records": ("megatron.core",)}


def needs(*names):
    """The runs a test reads (started together by the ``runs`` fixture)."""
    modules = sorted({m for name in names for m in RUN_NEEDS.get(name, ())})

    def mark(fn):
        fn.runs_needed = names
        return needs_modules(*modules)(fn) if modules else fn
    return mark


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, fake_nccl_dir):
    """Every run the selected tests of this module need, started at once."""
    wanted = set()
    for item in request.session.items:
        wanted.update(getattr(getattr(item, "function", None), "runs_needed", ()))
    wanted = {name for name in wanted if not missing(*RUN_NEEDS.get(name, ()))}
    started = start_all(wanted, str(tmp_path_factory.mktemp("gpu-drivers-on-cpu")))
    yield started
    for run in started.values():
        run.kill()


# --- core_gpu.py ------------------------------------------------------------
CORE_JUDGED = {"at_least_4_groups_suspended", "ctypes_path", "nccl_stats_say_suspended",
               "kept_group_works_during_phase", "guard_auto_resume_exact", "guard_counted",
               "exact_after_end", "exact_after_overlapped_cycle", "exact_every_cycle"}
CORE_NOT_JUDGED = {"freed_ge_99pct_of_suspendable", "caller_progress_ge_0.5",
                   "device_memory_flat_1pct", "host_rss_flat_1pct"}


def ranks_results(run: Run, name: str) -> list:
    """Both ranks' result files (``name`` with ``{rank}``), once every process passed."""
    run.passed()
    return [run.json(name.format(rank=rank)) for rank in (0, 1)]


@needs("core")
def test_core_gpu_runs_its_checks_on_the_fake_nccl(runs):
    for result in ranks_results(runs["core"], "core.rank{rank}.json"):
        assert result["ok"] and set(result["checks"]) == CORE_JUDGED, result["checks"]
        assert set(result["not_judged_on_cpu"]) == CORE_NOT_JUDGED
        held = result["first_begin"]["held"]  # policy.groups(read_nccl=True), as_dict()
        assert set(held) == set(result["first_begin"]["suspended"]) >= {"world", "dp", "ep"}
        assert all(v["nccl_suspended"] and v["status"] == "suspended" for v in held.values())
        assert result["counters"]["amem/total/auto_resumes"] == 1
        assert result["cycles"]["n"] == 3 and "libnccl-fake" in result["nccl_path"]
        assert_provenance(result, "tests/gpu/core_gpu.py")
        assert result["memory_measure"] == "process"  # the CPU stand-in answers as NVML would


# --- suspend_stall_gpu.py ------------------------------------------------------
@needs("suspend_stall")
def test_suspend_stall_measures_every_order_on_the_fake_nccl(runs):
    for result in ranks_results(runs["suspend_stall"], "stall.rank{rank}.json"):
        assert result["ok"] and result["checks"] == {"exact_after_every_cycle": True,
                                                     "every_mode_measured": True}
        assert set(result["not_judged_on_cpu"]) == {
            "overlap_finishes_first", "work_stalls_during_suspend", "pinning_alone_stalls",
            "allocation_waits_for_suspend", "held_first_step_on_time"}
        assert result["suspended"] == ["world", "dp"] and result["pinned_bytes"] > 0
        # the process's first begin, then one round of the seven modes (the command asks
        # for 1), then the baseline again
        assert [row["mode"] for row in result["rows"]] == [
            "first", "none", "overlapped", "serial", "pin_only", "alloc_none", "alloc_overlapped", "held",
            "none"]
        held = next(row for row in result["rows"] if row["mode"] == "held")
        # held until the first step ended, rank r r * 0.3 s later (the steps go on), or
        # until the work is over and the mode waits for the begin (a short CPU run)
        assert held["held_s"] >= min(held["first_step_ended_s"] + 0.3 * result["rank"],
                                     held["work_s"]) - 0.01
        summary = result["summary"]
        assert summary["none"]["work_ratio"] == summary["alloc_none"]["work_ratio"] == 1.0
        assert all(summary[m]["transition_s"] > 0 for m in (
            "first", "overlapped", "serial", "pin_only", "alloc_overlapped", "held"))
        assert summary["first"]["work_ratio"] > 0 and result["blocks"] == "registered"
        first = result["rows"][0]
        assert first["suspended"] == ["world", "dp"] and first["suspended_bytes"] > 0
        assert_provenance(result, "tests/gpu/suspend_stall_gpu.py")


# --- pin_paths_gpu.py -----------------------------------------------------------
@needs("pin_paths")
def test_pin_paths_times_a_cycle_through_every_kind_of_host_block_beside_the_work(runs):
    run = runs["pin_paths"]
    run.passed()
    result = run.json("pin.json")
    assert result["on_cpu"] and result["steps"] > 0 and result["piece_mib"] == 4
    assert set(result["modes"]) == {"pinned_fresh", "pinned_kept", "registered_fresh",
                                    "pageable_fresh", "pageable_kept"}
    for mode, figures in result["modes"].items():
        parts = figures["seconds_per_gib"]
        assert set(parts) == {"get", "copy_out", "copy_in", "release"}
        assert parts["copy_out"] > 0 and parts["copy_in"] > 0, mode  # every piece copied
        # blocks got beforehand are not timed; fresh ones are got and released in the cycle
        kept = mode.endswith("_kept")
        assert (parts["get"] == 0 and parts["release"] == 0) == kept, (mode, parts)
        assert figures["cycle_s_per_gib"] >= sum(parts.values()) * 0.99
        assert figures["work_rate_vs_baseline"] > 0 and figures["work_lost_s_per_gib"] >= 0
    # the baseline first and last, one round of each mode between, the work beside each
    assert len(result["raw"]["None"]) == 2 and len(result["raw"]["pageable_kept"]) == 1
    assert all(r["steps"] >= 1 for r in result["raw"]["pinned_fresh"])
    assert_provenance(result, "tests/gpu/pin_paths_gpu.py")


# --- host_backup_gpu.py -------------------------------------------------------
@needs("host_backup")
def test_host_backup_soak_keeps_the_backup_on_the_fake_runtime(runs):
    for result in ranks_results(runs["host_backup"], "hb.rank{rank}.json"):
        assert result["ok"] and result["hook"]["installed"] and not result["failures"]
        assert set(result["checks"]) == {
            "no_failure", "every_resume_exact", "every_cycle_suspended", "hook_active",
            "no_new_pinning_after_first_cycle", "kept_bytes_flat", "nothing_kept_after_close"}
        assert set(result["not_judged_on_cpu"]) == {"device_free_flat", "host_rss_flat"}
        cycles = result["cycles"]
        assert len(cycles) == 30 and all(c["bytes"] == 2 * 64 * 2**20 for c in cycles)
        # two communicators of six entries: pinned in the first cycle, reused after
        assert [c["pinned_new"] for c in cycles] == [12] * 30
        assert [c["reused"] for c in cycles] == [12 * i for i in range(30)]
        assert result["commit"] and result["machine"]["nccl_loaded"].startswith("2.32.3")
        assert result["after_close"]["kept_bytes"] == 0


# --- cold_host_gpu.py ---------------------------------------------------------
@needs("cold_host")
def test_cold_host_gpu_times_each_cycle_under_the_default_timeouts(runs):
    run = runs["cold_host"]
    run.passed()
    result = run.json("cold.json")
    assert result["ok"] and result["mode"] == "cpu-fake-nccl" and result["ranks"] == 2
    for record in result["ranks_records"]:
        assert all(record["checks"].values()) and len(record["checks"]) == 5, record["checks"]
        assert len(record["cycles"]) == 2 and len(record["warm_suspend_s"]) == 1
        assert all(len(c["suspended"]) == 3 for c in record["cycles"])
        assert record["defaults"]["agree_timeout_s"] == 120.0  # the package's own default
        assert record["defaults"]["timeout_s"] is None
    assert set(result["cpu_notes"]["not_judged_on_cpu"]) == {
        "first_suspend_below_every_default_timeout"}


# --- multinode_gpu.py ---------------------------------------------------------
@needs("multinode")
def test_multinode_gpu_runs_its_four_cases_over_simulated_hosts(runs):
    run = runs["multinode"]
    run.passed()
    summary = run.json("multinode.json")
    assert summary["ok"] and summary["world"] == 4, summary["checks"]
    assert summary["checks"]["guard_resumed_dp"] and summary["checks"]["transport_reported"]
    for rank in summary["ranks"]:
        assert set(rank["cases"]) == {"overlap_off", "overlap_on_4_workers", "guard_resume",
                                      "disagreeing_keep"}
        # NCCL_HOSTID gives every rank its own host: the package says every group
        # crosses hosts, as on the GPU host, but the DP groups of one rank here
        groups = rank["cases"]["overlap_off"]["groups"]
        assert all(g["transport"] == "intra-node" if name == "dp" else
                   g["transport"].startswith("network") for name, g in groups.items()), groups
    # the driver's own command (it starts the ranks), not a rank's
    assert_provenance(summary, "tests/gpu/multinode_gpu.py", "--ranks 4")
    assert "--rank " not in summary["command"]


# --- reliability_gpu.py -----------------------------------------------------------
def test_every_reliability_case_runs_on_cpu_or_says_why_not():
    from tests.gpu import reliability_gpu

    chosen = [case for cases in RELIABILITY.values() for case in cases]
    assert len(chosen) == len(set(chosen))
    assert set(chosen) | set(RELIABILITY_GPU_ONLY) == set(reliability_gpu.CASES)


def test_what_the_gpu_only_reliability_cases_read_is_still_there(fake_nccl_dir):
    """old_nccl and amem_unusable cannot run here; the package names they use can
    be read: a library's version and suspend symbols (on the fake's build of an
    older NCCL) and the amem backend's library_path option."""
    from amem_callbacks.nccl_library import SUSPEND_MIN_VERSION, NcclLibrary
    from amem_callbacks.options import OffloadOptions
    from tests.fake_nccl import build

    old = NcclLibrary.open(build("old", fake_nccl_dir))
    assert not (old.has_suspend and old.version >= SUSPEND_MIN_VERSION) and old.version_str
    OffloadOptions(backend="amem",
                   backend_options={"amem": {"library_path": "/nonexistent/amem/libnccl.so.2"}})


@needs(*RELIABILITY)
@pytest.mark.parametrize("name", list(RELIABILITY))
def test_reliability_gpu_cases_hold_on_the_fake_nccl(runs, name):
    run = runs[name]
    run.passed()
    table = run.json(f"{name}.json")
    assert table["mode"] == "cpu-fake" and table["complete"] and table["ok"]
    assert [row["case"] for row in table["table"]] == RELIABILITY[name]
    # True, not "not applicable" (None): every chosen case is judged on CPU
    assert all(row["ok"] is True for row in table["table"]), table["table"]
    assert_provenance(table, "tests/gpu/reliability_gpu.py", *RELIABILITY[name])


def assert_provenance(result: dict, script: str, *words: str) -> None:
    """common.provenance: the commit and the command as run. The commit is what
    run_commit says here (a clone's HEAD, or an export's AMEM_COMMIT or COMMIT file:
    test_gpu_suite_report tests each); a GPU host runs this suite on an export."""
    assert result["commit"] == common.run_commit(ROOT), result["commit"]
    assert script in result["command"] and all(w in result["command"] for w in words), \
        (result["command"], script, words)
    assert result["env"][common.CPU_ENV] == "1"


# --- soak_gpu.py ----------------------------------------------------------------
@needs("soak")
def test_soak_gpu_follows_the_shared_cpu_mode(runs):
    run = runs["soak"]
    run.passed()
    result = run.json("soak.json")
    assert result["ok"] and result["mode"] == "cpu-fake-nccl" and result["cycles"] == 14
    assert f"{common.CPU_ENV}=1" in result["command"]
    for counts in result["special_cycles"].values():  # guard 3, 8, 13; learned 4, 9, 14; disagree 7
        assert counts == {"guard": 3, "learned": 3, "disagree": 1,
                          "disagree_member": 1}, counts
    assert result["shared_gpu"] is True
    for name, per_rank in result["flat"].items():
        assert all(v["ok"] is (None if name.startswith("device_free") else True)
                   for v in per_rank.values()), (name, per_rank)
    for v in result["flat"]["device_free_during"].values():  # --shared-gpu: judged per process
        assert "--shared-gpu" in v["why"], v
    for values in result["series"]["device_process_during"].values():
        assert values and set(values) == {common.STAND_IN_PROCESS_BYTES}, values
    for counters in result["counters"].values():
        assert counters["main"]["amem/total/auto_resumes"] == 3


# --- trl_gpu.py -------------------------------------------------------------------
@needs("trl")
def test_trl_gpu_suspends_world_at_every_generation_on_the_fake_nccl(runs):
    run = runs["trl"]
    run.passed()
    summary = run.json("trl.json")
    assert summary["ok"], [r["checks"] for r in summary["ranks"]]
    for rank in summary["ranks"]:
        assert set(rank["not_judged_on_cpu"]) == {"amem_freed_ge_99pct_of_suspendable",
                                                  "amem_independent_freed_ge_99pct"}
        assert rank["checks"]["amem_world_suspended_every_generation"]
        assert rank["checks"]["amem_metrics_in_trainer_logs"]
        for name in ("amem", "amem_overlap"):
            assert rank["runs"][name]["backend"] == "nccl"
            assert "libnccl-fake" in rank["runs"][name]["nccl_library"]
            assert [b["suspended"] for b in rank["runs"][name]["begins"]] == [["world"]] * 2
    assert_provenance(summary, "tests/gpu/trl_gpu.py", "--steps 2", "--completion-length 8")


# --- verl_gpu.py ------------------------------------------------------------------
@needs("verl")
def test_verl_gpu_worker_suspends_and_resumes_on_the_fake_nccl(runs):
    run = runs["verl"]
    run.passed()
    summary = run.json("verl.json")
    checks = summary["checks"]
    assert summary["ok"] and summary["amem"] == "nccl", checks
    assert checks["groups_suspended_every_step"] and checks["every_suspended_group_resumed"]
    assert checks["amem_metrics_from_every_rank"] and checks["no_collective_on_a_suspended_group"]
    assert summary["driver_merged_amem_metrics"]["amem/total/begins"] == 2
    for rank in summary["ranks"]:
        assert rank["amem_backend"]["name"] == "nccl"
        assert "libnccl-fake" in rank["amem_backend"]["nccl"]
        assert "world" in rank["steps"][0]["amem_begin"]["suspended"]
    assert_provenance(summary, "tests/gpu/verl_gpu.py", "verl.json --steps 2")


@needs("verl")
def test_verl_gpu_summary_records_the_wrapper_command_and_each_run(runs, tmp_path):
    """verl_gpu.sh's last step (its three runs are verl_gpu.py as above): the
    summary says the wrapper's command, as the wrapper names it, and each run's."""
    run = runs["verl"]
    run.passed()
    assert f'{common.RUN_COMMAND_ENV}="${{COMMAND% }}" python3 tests/gpu/verl_gpu.py summary' in \
        open(os.path.join(ROOT, "tests", "gpu", "verl_gpu.sh")).read()
    one, out = os.path.join(run.out, "verl.json"), str(tmp_path / "summary.json")
    wrapper = "tests/gpu/verl_gpu.sh /tmp/verl-out --steps 2"
    proc = subprocess.run([sys.executable, gpu_script("verl_gpu.py"), "summary", out, one, one,
                           one], cwd=ROOT, env=driver_env(**{common.RUN_COMMAND_ENV: wrapper}),
                          capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        summary = json.load(f)
    assert summary["ok"] and summary["command"] == wrapper
    assert_provenance(summary, "tests/gpu/verl_gpu.sh")
    assert {n: r["command"] for n, r in summary["runs"].items()} == dict.fromkeys(
        ("baseline", "amem", "control"), run.json("verl.json")["command"])


# --- megatron_gpu.py ---------------------------------------------------------------
@needs("megatron")
def test_megatron_gpu_hooks_suspend_the_training_groups_through_the_launcher(runs):
    run = runs["megatron"]
    run.passed()
    summary = run.json("megatron_gpu.json")
    assert summary["ok"] and summary["launcher"], summary
    # the driver's own command; each rank's is the torchrun line the driver ran
    assert_provenance(summary, "tests/gpu/megatron_gpu.py", "--configs separate")
    assert list(summary["configs"]) == ["separate"] and not summary["configs"]["separate"][
        "failed_checks"]
    for rank in (0, 1):
        result = run.json(f"megatron_gpu.separate.rank{rank}.json")
        assert result["via_launcher"] and result["ok"]
        assert set(result["not_judged_on_cpu"]) == {"freed_ge_99pct_of_suspendable",
                                                    "memory_back_after_end"}
        assert_provenance(result, "tests/gpu/megatron_gpu.py",
                          "-m torch.distributed.run --nproc-per-node 2 -m "
                          "amem_callbacks.adapters.megatron", "--worker separate")
        for cycle in result["cycles"]:
            assert cycle["checks"]["nccl_says_suspended_exactly_those"]
            assert cycle["checks"]["every_training_group_idle"] and "world" in cycle["suspended"]


# --- megatron_rl_gpu.py and megatron_matrix.py -----------------------------------------
def megatron_rl_records(args):
    """Rank scenario (tests.scenarios): megatron-core's parallel_state on gloo, the
    adapter over the fake NCCL, the hooked engine of megatron_gpu.py for a few
    rollouts; then megatron_rl_gpu.py writes its per-rank record, as it does
    before Megatron's shutdown."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from tests.gpu import megatron_engine, megatron_gpu, megatron_rl_gpu
    from tests.scenarios import init

    init()
    common.bind_device()  # the torch.cuda stand-in the engine's suspend/resume calls
    ps.initialize_model_parallel()
    adapter = megatron_gpu.import_adapter()
    controller = adapter.install(settings=adapter.Settings(enabled=True, backend="nccl"),
                                 backend=common.stand_in_backend())
    engine = megatron_engine.make_engine(ProcessGroupCollection.use_mpu_process_groups())
    for _ in range(args["rollouts"]):
        engine.resume()
        engine.suspend()
        controller.policy.wait()
    megatron_rl_gpu.write_record(args["prefix"])
    return {"reports": len(controller.reports)}


def recorded_with_fresh_amem(fresh_prefix: str, folder: str, name: str = "amem") -> str:
    """The recorded GPU run's per-rank records with their "amem" part (what the
    package reported) replaced by this machine's, from the current package."""
    os.makedirs(folder, exist_ok=True)
    for rank in (0, 1):
        with open(os.path.join(RECORDED_MEGATRON, f"amem.rank{rank}.json")) as f:
            record = json.load(f)
        with open(f"{fresh_prefix}.rank{rank}.json") as f:
            record["amem"] = json.load(f)["amem"]
        with open(os.path.join(folder, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(record, f)
    return os.path.join(folder, name)


def recorded(folder: str, name: str) -> str:
    os.makedirs(folder, exist_ok=True)
    for path in glob.glob(os.path.join(RECORDED_MEGATRON, f"{name}.rank*.json")):
        shutil.copy(path, folder)
    return os.path.join(folder, name)


@needs("megatron_rl_records")
def test_megatron_rl_gpu_record_merges_with_the_recorded_runs(runs, tmp_path):
    from tests.gpu import megatron_rl_gpu

    run = runs["megatron_rl_records"]
    run.passed()
    prefix = os.path.join(run.out, "amem")
    for rank in (0, 1):
        record = run.json(f"amem.rank{rank}.json")
        assert record["rank"] == rank and not record["errors"], record["errors"]
        amem = record["amem"]
        assert amem["installed"] and "inference: keep" in amem["rollout_groups"]
        begins = [t for t in amem["transitions"] if t["kind"] == "begin"]
        assert len(begins) == MEGATRON_RL_ROLLOUTS and all("world" in t["suspended"]
                                                          for t in begins)
        assert all(t["nccl_bytes"] > 0 and t["groups"] for t in begins)
        assert amem["metrics"]["amem/total/auto_resumes"] == 0

    summary = megatron_rl_gpu.merge(recorded(str(tmp_path), "baseline"),
                                    recorded_with_fresh_amem(prefix, str(tmp_path)),
                                    recorded(str(tmp_path), "control"),
                                    str(tmp_path / "summary.json"))
    checks = summary["checks"]
    assert checks["every rank of every run wrote its record (no hang, no crash)"]
    assert checks["groups were suspended at every rollout"]
    assert checks["no collective reached a suspended group (guard resumes 0)"]
    # the free-memory check weighs GPU readings against the fake's bytes: computed, not judged
    assert summary["gpu_suspended_nccl_bytes"] > 0 and summary["median_free_gain_bytes"]


@needs("megatron_rl_records")
def test_megatron_matrix_summarises_the_current_record(runs, tmp_path):
    from tests.gpu import megatron_matrix

    run = runs["megatron_rl_records"]
    run.passed()
    cell = tmp_path / "do_ogr_opg"
    recorded(str(cell), "baseline")
    recorded_with_fresh_amem(os.path.join(run.out, "amem"), str(cell))
    outcomes = {side: {"name": f"do_ogr_opg/{side}", "rc": 0, "hung": False}
                for side in ("baseline", "amem")}
    summary = megatron_matrix.summarise("do_ogr_opg", outcomes, str(tmp_path))
    amem = summary["runs"]["amem"]
    assert summary["ok"] and summary["verdict"].startswith("pass: no crash"), summary
    assert amem["guard_resumes"] == 0 and len(amem["suspended_per_rollout"]) == \
        MEGATRON_RL_ROLLOUTS and "world" in amem["suspended_per_rollout"][0]
    assert "inference: keep" in amem["rollout_groups"]


def test_every_rl_amem_flag_the_drivers_pass_is_the_adapters():
    """The launchers' command lines (megatron_gpu.py, experiments/gpu_runs.py, the matrix
    cells, megatron_rl_gpu.sh) against the adapter's own parser."""
    from amem_callbacks.adapters.megatron.args import launcher_parser, settings_from_args

    flag = re.compile(r"--rl-amem-[a-z0-9-]+")
    named = set()
    for path in glob.glob(os.path.join(ROOT, "tests", "gpu", "*")):
        if path.endswith((".py", ".sh")):
            named |= set(flag.findall(open(path).read()))
    assert {"--rl-amem-offload-during-rollout", "--rl-amem-backend",
            "--rl-amem-grow-kv-cache"} <= named
    defined = set(flag.findall(launcher_parser().format_help()))
    assert named <= defined, named - defined
    # the launcher the command lines name (megatron_runs.command, megatron_gpu.main)
    assert importlib.util.find_spec("amem_callbacks.adapters.megatron.__main__")

    from experiments import gpu_runs as megatron_runs
    from tests.gpu import megatron_gpu, megatron_matrix

    for flags in (megatron_gpu.FLAGS, megatron_runs.AMEM_FLAGS,
                  *(megatron_runs.AMEM_FLAGS + cell[2] for cell in megatron_matrix.CELLS.values())):
        ours, rest = launcher_parser().parse_known_args(list(flags))
        settings = settings_from_args(ours)
        assert not rest and settings.enabled and settings.backend == "nccl", flags


def test_megatron_rl_gpu_wraps_megatron_the_way_the_package_patching_takes(monkeypatch):
    """Its probes wrap megatron.rl and Megatron-LM's training, which CI lacks:
    each call of the package's Patches.wrap and wrapper in it must still fit
    their signatures; and its GPU mapping runs here."""
    from amem_callbacks.patching import Patches, wrapper
    from tests.gpu import megatron_rl_gpu

    takes = {"wrap": inspect.signature(Patches.wrap), "wrapper": inspect.signature(wrapper)}
    calls = {"wrap": 0, "wrapper": 0}
    for node in ast.walk(ast.parse(open(megatron_rl_gpu.__file__).read())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) and isinstance(
            func.value, ast.Name) and func.value.id == "_patches" else getattr(func, "id", None)
        if name in takes:
            calls[name] += 1
            bound = [None] * (len(node.args) + (name == "wrap"))  # self, then the arguments
            takes[name].bind(*bound, **{k.arg: None for k in node.keywords})  # TypeError: no
    assert calls["wrap"] >= 6 and calls["wrapper"] >= 1, calls
    import torch

    monkeypatch.setenv("LOCAL_RANK", "3")
    megatron_rl_gpu.share_the_gpu()  # the package's local_device: round robin over the GPUs
    assert os.environ["LOCAL_RANK"] == str(3 % max(1, torch.cuda.device_count()))


# --- usage lines ---------------------------------------------------------------------
PATH = re.compile(r"(?<![\w./$-])((?:tests|results|docs|experiments|examples|adapters|"
                  r"amem_callbacks)/[\w./*-]*[\w*])")


def usage_texts():
    """Each driver's module docstring (or a shell script's comments), and
    results/README.md: where the commands people copy are written."""
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "gpu", "*.[ps][yh]"))):
        text = open(path).read()
        if path.endswith(".py"):
            yield path, ast.get_docstring(ast.parse(text)) or ""
        elif path.endswith(".sh"):
            yield path, "\n".join(line for line in text.splitlines() if line.startswith("#"))
    yield os.path.join(ROOT, "results", "README.md"), open(
        os.path.join(ROOT, "results", "README.md")).read()


def test_usage_lines_name_paths_that_exist():
    missing = [(os.path.relpath(path, ROOT), named) for path, text in usage_texts()
               for named in PATH.findall(text) if not glob.glob(os.path.join(ROOT, named))]
    assert not missing, missing
