"""The host-backup hook (amem_callbacks/csrc, host_backup.py) against a stand-in
driver and a stand-in NCCL whose runtime finds the driver through dlsym, as NCCL's
static CUDA runtime does: install, reuse, bound, windows, release, the off switches,
the refusals, and that nothing but that NCCL's look-ups changes. Each case runs in a
fresh process (the hook is process-wide)."""

import json
import os
import subprocess
import sys

import pytest

from amem_callbacks import host_backup
from tests.harness import run_ranks
from tests.fake_nccl import build_driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES, ENTRY_BYTES = 4, 1 << 16
NBYTES_ALL = ENTRIES * ENTRY_BYTES

pytestmark = pytest.mark.skipif(host_backup.library_path() is None,
                                reason="the hook was not built (pip install -e . builds it)")


def case(name: str, folder) -> dict:
    env = {k: v for k, v in os.environ.items() if k != host_backup.ENV_SWITCH}
    done = subprocess.run([sys.executable, "-m", "tests.host_backup_cases", name, str(folder)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_first_suspend_pins_by_registering_and_every_later_one_reuses(tmp_path):
    out = case("reuse", tmp_path)
    assert out["state"]["installed"] and out["active"]
    assert out["exact"] == [True] * 5
    before = out["before_release"]
    # only the first cycle pinned, by registering pages it mapped: nothing from
    # cuMemHostAlloc (the stand-in reports 2.32.3, a release read)
    assert before["registers"] == ENTRIES and before["pins"] == 0
    assert before["unregisters"] == before["unpins"] == 0
    stats = before["stats"]
    assert stats["registered_on"] == 1 and stats["register_failed"] == 0
    assert stats["registered_new"] == stats["pinned_new"] == ENTRIES
    assert stats["registered_new_bytes"] == NBYTES_ALL
    assert stats["reused"] == 4 * ENTRIES
    # NCCL zeroes each backup, then copies over all of it: the zeroing of a reused block
    # and of a new mapping (its pages are zero) is left out; the image still comes back
    # exact, and the stand-in's other memsets still ran
    assert stats["zero_skipped"] == 5 * ENTRIES
    assert stats["kept_bytes"] == before["pinned_bytes"] == NBYTES_ALL
    assert out["released"] == NBYTES_ALL
    after = out["after_release"]
    # released by unregistering (and unmapping), never through cuMemFreeHost
    assert after["pinned_bytes"] == 0 and after["unregisters"] == ENTRIES
    assert after["unpins"] == 0 and after["bad_frees"] == 0
    assert after["stats"]["kept_bytes"] == 0 and after["stats"]["unpinned"] == ENTRIES
    assert out["metrics"]["amem/host_backup/registered_new"] == ENTRIES


def _pinned_as_nccl_asked(out, registered_on=0):
    assert out["exact"] == [True] * 5 and out["active"]
    before = out["before_release"]
    assert before["pins"] == ENTRIES and before["registers"] == 0  # the first cycle only
    stats = before["stats"]
    assert stats["registered_on"] == registered_on and stats["registered_new"] == 0
    assert stats["pinned_new"] == ENTRIES and stats["reused"] == 4 * ENTRIES
    after = out["after_release"]
    assert after["pinned_bytes"] == 0 and after["unpins"] == ENTRIES
    assert after["unregisters"] == 0 and after["bad_frees"] == 0
    return stats


def test_allocated_blocks_are_nccls_own_cuMemHostAlloc(tmp_path):
    stats = _pinned_as_nccl_asked(case("allocated", tmp_path))
    assert stats["zero_skipped"] == 4 * ENTRIES  # only the reused blocks' zeroing


def test_an_nccl_not_read_never_gets_registered_blocks(tmp_path):
    stats = _pinned_as_nccl_asked(case("registered_refused", tmp_path))
    assert stats["zero_skipped"] == 0


def test_a_refused_registration_falls_back_to_nccls_pinning_once_for_all(tmp_path):
    stats = _pinned_as_nccl_asked(case("register_fails", tmp_path))
    assert stats["register_failed"] == 1  # tried once, then off


def test_a_bad_blocks_value_fails_at_start_up_with_what_to_write(tmp_path):
    out = case("bad_blocks_value", tmp_path)
    assert "AMEM_HOST_BACKUP_BLOCKS='pageable'" in out["raised"]
    assert "registered or allocated" in out["raised"]
    assert not out["state"]["installed"] and out["state"]["why"] == out["raised"]


def test_an_nccl_not_read_keeps_every_zeroing(tmp_path):
    out = case("zeroing_kept", tmp_path)
    assert out["exact"] == [True] * 3
    assert out["stats"]["reused"] == 2 * ENTRIES and out["stats"]["zero_skipped"] == 0


def test_kept_bytes_stay_within_the_bound(tmp_path):
    out = case("bounded", tmp_path)
    assert out["exact"] == [True] * 3
    during = out["during"]
    assert during["stats"]["kept_bytes"] == 2 * ENTRY_BYTES  # two of four blocks kept
    assert during["stats"]["reused"] == 2 * 2  # cycles 2 and 3 reuse two each
    assert during["registers"] == ENTRIES + 2 * 2 and during["pins"] == 0
    assert during["unregisters"] == 2 * 3 and during["bad_frees"] == 0  # two a resume
    assert out["after_lowering"]["stats"]["kept_bytes"] == 0
    assert out["after_lowering"]["pinned_bytes"] == 0


def test_outside_the_windows_allocations_and_frees_reach_the_driver(tmp_path):
    out = case("outside_windows", tmp_path)
    assert out["exact"] == [True] * 3
    figures = out["figures"]
    assert figures["pins"] == figures["unpins"] == 3 * ENTRIES
    assert figures["stats"]["reused"] == 0 and figures["stats"]["kept_bytes"] == 0


def test_reuse_off_pins_every_cycle_and_keeps_nothing(tmp_path):
    out = case("reuse_off", tmp_path)
    assert out["kept_while_on"] == ENTRIES * ENTRY_BYTES
    assert out["exact"] == [True] * 3
    figures = out["figures"]
    assert figures["stats"]["kept_bytes"] == 0 and figures["pinned_bytes"] == 0
    # the first cycle registered; with reuse off, three cycles pinned as NCCL asks
    assert figures["registers"] == figures["unregisters"] == ENTRIES
    assert figures["pins"] == figures["unpins"] == 3 * ENTRIES
    assert "reuse_host_backup=False" in out["why"]


def test_the_environment_switch_installs_nothing(tmp_path):
    out = case("switched_off", tmp_path)
    assert not out["state"]["installed"] and "AMEM_HOST_BACKUP=0" in out["state"]["why"]
    assert out["exact"] == [True, True]
    assert out["figures"]["pins"] == out["figures"]["unpins"] == 2 * ENTRIES
    assert out["figures"]["stats"] == {}


def test_a_hook_installed_after_the_runtime_started_says_so(tmp_path):
    out = case("late", tmp_path)
    assert out["state"]["installed"] and not out["active"]
    assert "reached the driver before the hook was installed" in out["why"]
    assert out["exact"] == [True, True] and out["figures"]["pins"] == 2 * ENTRIES


def test_an_nccl_it_cannot_hook_is_refused_with_why(tmp_path):
    out = case("refusals", tmp_path)
    assert not out["no_dlsym"]["installed"] and "imports no dlsym" in out["no_dlsym"]["why"]
    assert not out["not_loaded"]["installed"]
    assert "not loaded in this process" in out["not_loaded"]["why"]
    assert not out["installed"]


def test_only_that_nccls_lookups_change(tmp_path):
    out = case("scoped", tmp_path)
    # dlsym(RTLD_NEXT) from the hooked NCCL still searches after it, not after the hook
    assert out["before"] == out["after"] == out["expected"] != 0
    # a second NCCL copy's runtime reaches the real driver: it pins every cycle
    assert out["exact_other"] == [True] * 3 and out["other_pins"] == 3 * ENTRIES
    assert out["stats"]["reused"] == 0


def _ranks(scenario: str, tmp_path, **args):
    driver = build_driver(str(tmp_path))
    return [r["result"] for r in run_ranks(f"tests.scenarios_host_backup:{scenario}", world=2,
                                           timeout=120, args={"driver": driver, **args})]


def test_a_policy_keeps_the_backup_from_one_phase_to_the_next(tmp_path):
    for result in _ranks("scenario_keeps_backup", tmp_path):
        cycles = result["cycles"]
        assert [c["suspended"] for c in cycles] == [["dp", "ep", "world"]] * 4
        assert all(all(c["exact"].values()) and c["collectives_ok"] for c in cycles)
        pinned = [c["driver_registers"] for c in cycles]  # three comms of six entries, once
        assert pinned == [3 * 6] * 4 and [c["driver_pins"] for c in cycles] == [0] * 4
        reused = [c["metrics"]["amem/host_backup/reused"] for c in cycles]
        assert reused == [0, 18, 36, 54]
        assert cycles[-1]["metrics"]["amem/host_backup/active"] == 1
        assert result["kept_before_close"] == 3 * 6 * 64 * 1024
        assert result["after_close"] == {"kept_bytes": 0, "driver_pinned_bytes": 0,
                                         "bad_frees": 0}
        assert any("keeping NCCL's pinned host backup" in line for line in result["log"])


def test_a_policy_with_reuse_off_pins_every_phase(tmp_path):
    for result in _ranks("scenario_keeps_backup", tmp_path, reuse=False):
        cycles = result["cycles"]
        assert all(all(c["exact"].values()) for c in cycles)
        assert [c["driver_pins"] for c in cycles] == [18, 36, 54, 72]
        assert all(c["metrics"] == {} for c in cycles)


def test_a_policy_made_after_the_communicators_says_why_once(tmp_path):
    for result in _ranks("scenario_late_install", tmp_path):
        assert all(all(c["exact"].values()) for c in result["cycles"])
        assert [c["driver_pins"] for c in result["cycles"]] == [18, 36, 54]
        lines = [l for l in result["log"] if "re-pins its host backup" in l]
        assert len(lines) == 1 and "before the first NCCL communicator" in lines[0]
        assert result["bad_frees"] == 0


def test_the_bench_stage_times_both_sides_and_the_copy(tmp_path):
    for result in _ranks("scenario_bench_stage", tmp_path):
        blocks = result["blocks"]
        assert [b["reuse"] for b in blocks] == [False, True, False, True]
        for block in blocks:
            assert len(block["cycles"]) == 2
            new = [row["pinned_new"] for row in block["cycles"]]
            reused = [row["reused"] for row in block["cycles"]]
            # warm cycles: re-pinned every time with reuse off, never with it on
            assert (new, reused) == (([18, 18], [0, 0]) if not block["reuse"] else
                                     ([0, 0], [18, 18]))
            assert [row["zero_skipped"] for row in block["cycles"]] == \
                ([18, 18] if block["reuse"] else [0, 0])
        assert result["first_cycle"]["pinned_new"] == 18
        assert result["bytes"] == 3 * 32 * 2**20  # NCCL's suspendable bytes as stated
        assert set(result["floor"]) == {"d2h_s", "h2d_s", "memset_s"}
        summary = result["summary"]
        assert summary["on"]["cycle_s_per_gib"] > 0 and summary["copy_s_per_gib"] > 0


def test_the_recorded_summary_is_what_its_records_say():
    """results/one_h100/host_backup_reuse/summary.json is tests/gpu/host_backup_summary.py's
    reading of the rank records beside it: a record changed without it fails here."""
    import tests.gpu.host_backup_summary as summary

    folder = os.path.join(ROOT, "results", "one_h100", "host_backup_reuse")
    with open(os.path.join(folder, "summary.json")) as f:
        recorded = json.load(f)
    assert summary.summarise(folder) == recorded
    assert recorded["bench"]["kept"]["cycle_s_per_gib"] < recorded["bench"]["re_pinned"][
        "cycle_s_per_gib"]
    assert all(rank["ok"] and rank["cycles"] == 1000 for rank in recorded["soak"].values())


@pytest.mark.parametrize("kept", [True, False])
def test_the_doctor_says_when_nccl_would_re_pin_its_backup(monkeypatch, kept):
    """The probe's line (tools/probe.py, a real 1-rank cycle on a GPU) read by the doctor."""
    from amem_callbacks.tools import doctor

    line = json.dumps({"ok": True, "path": "ctypes", "host_backup": {
        "kept": kept, "why_not": "" if kept else "NCCL's CUDA runtime has not taken it",
        "reused": 3 if kept else 0}})
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout=line + "\n", stderr=""))
    diagnosis = doctor.Diagnosis()
    doctor._probe(diagnosis)
    said = [p.what for p in diagnosis.problems if "host backup" in p.what]
    assert said == ([] if kept else [said[0]]) and diagnosis.facts["probe"]["host_backup"]
    if not kept:
        assert "has not taken it" in said[0]


def test_the_doctor_says_when_the_hook_is_in_place_but_reused_nothing(monkeypatch):
    # a probe whose second suspend pinned afresh: the hook saw NCCL's allocations but
    # handed none back (what the probe itself measured on torch 2.15 before its bound
    # came first)
    from amem_callbacks.tools import doctor

    line = json.dumps({"ok": True, "path": "ctypes",
                       "host_backup": {"kept": True, "why_not": "", "reused": 0}})
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout=line + "\n", stderr=""))
    diagnosis = doctor.Diagnosis()
    doctor._probe(diagnosis)
    said = [p.what for p in diagnosis.problems if "host-backup hook" in p.what]
    assert len(said) == 1 and "pinned new memory" in said[0]


def test_the_probe_bounds_the_backup_before_its_first_suspend():
    # the order is the point: a bound set after the first resume keeps nothing to reuse
    import inspect

    from amem_callbacks.tools import probe

    source = inspect.getsource(probe.probe)
    assert source.index("host_backup.bound(") < source.index("backend.suspend(handle)")


def test_each_adapter_installs_the_hook_where_it_comes_before_the_communicators(monkeypatch):
    """The TRL callback's constructor, Megatron's add_args (the flag read from the command
    line: it runs before Megatron parses) and verl's init_model wrapper install it; with
    reuse turned off they do not."""
    import argparse

    import amem_callbacks.adapters.megatron as megatron
    from amem_callbacks.adapters import trl, verl

    calls = []
    monkeypatch.setattr(host_backup, "install", lambda path=None: calls.append(path))
    monkeypatch.setattr(host_backup, "installed", lambda: False)

    trl.AMemCallback()
    trl.AMemCallback(reuse_host_backup=False)
    assert calls == [None]

    monkeypatch.setattr(sys, "argv", ["train_rl.py", "--rl-amem-offload-during-rollout"])
    megatron.add_args(argparse.ArgumentParser())
    monkeypatch.setattr(sys, "argv", ["train_rl.py", "--rl-amem-offload-during-rollout",
                                      "--rl-amem-no-host-backup-reuse"])
    megatron.add_args(argparse.ArgumentParser())
    monkeypatch.setattr(sys, "argv", ["train_rl.py"])
    megatron.add_args(argparse.ArgumentParser())
    assert calls == [None, None]

    class Worker:
        def __init__(self, block):
            self.config = type("Config", (), {"rollout": {"custom": {"amem": block}}})()

    verl._validate_first(Worker({"enable": True}))
    verl._validate_first(Worker({"enable": True, "reuse_host_backup": False}))
    verl._validate_first(Worker({"enable": False}))
    assert calls == [None, None, None]
