"""tests/gpu/trl_vllm_gpu.py (issue 34) on CPU: its own code, before it meets a GPU.

- vLLM's log lines it reads (KV cache size, sleep, wake-up, out of memory), on
  sample lines written in vLLM 0.31.0's format strings;
- its CPU mode (tests/gpu/common.py: gloo, the fake NCCL behind AMemCallback, a
  stand-in for ``vllm.LLM`` under trl 1.16's real VLLMGeneration and GRPOTrainer):
  the order of trl's weight sync, vLLM's wake-ups, generate and sleep around the
  callback's begin and end, what each rank writes, and a run refused at start-up;
- the orchestrator: the edge share from a probe, the raised shares, the ABBA plan,
  the merge of a run's ranks and the summary (``raised_share_fails_without``), on
  synthetic records and once end to end through torchrun on CPU.

Device memory and time are not judged here (the stand-in's device is constant).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from amem_callbacks.tools.launch import free_port  # noqa: E402
from tests.gpu import common  # noqa: E402
from tests.gpu import trl_vllm_gpu as drv  # noqa: E402
from tests.test_experiment_runs import alive  # noqa: E402 - a /proc reading, not the code tested

GIB = 2**30
DRIVER = os.path.join("tests", "gpu", "trl_vllm_gpu.py")
TINY = ["--steps", "4", "--batch", "2", "--steps-per-generation", "2", "--num-generations", "4",
        "--completion-length", "8", "--max-model-len", "64", "--prompt-words", "4",
        "--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2"]
LIMIT_S = 500

# Sample lines in vLLM 0.31.0's formats (the format strings of gpu_worker.py,
# kv_cache_utils.py, executor/abstract.py, cumem_allocator and torch's allocator),
# with the prefixes its logger and an exception traceback put in front.
SAMPLES = [
    "INFO 12-02 09:14:01 [gpu_worker.py:773] Available KV cache memory: 1.02 GiB",
    "INFO 12-02 09:14:01 [kv_cache_utils.py:1148] GPU KV cache size: 10,880 tokens, Maximum "
    "concurrency for 2,048 tokens per request: 5.31x",
    "INFO 12-02 09:14:09 [gpu_worker.py:336] Sleep mode freed 2.65 GiB memory, 63.20 GiB memory "
    "is still in use.",
    "INFO 12-02 09:14:30 [abstract.py:426] It took 0.412345 seconds to wake up tags ['weights'].",
    "INFO 12-02 09:14:31 [abstract.py:426] It took 0.098765 seconds to wake up tags ['kv_cache'].",
    "INFO 12-02 09:14:40 [gpu_worker.py:336] Sleep mode freed 2.61 GiB memory, 63.24 GiB memory "
    "is still in use.",
    # info_once in vLLM; a second engine in the process would log its own: the first counts
    "INFO 12-02 09:15:01 [gpu_worker.py:773] Available KV cache memory: 9.99 GiB",
]
OOM_SAMPLES = {
    "cuMem out of memory (sleep-mode wake-up)":
        "RuntimeError: CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62",
    "start-up: free memory below the share":
        "ValueError: Free memory on device cuda:0 (40.5/139.8 GiB) on startup is less than "
        "desired GPU memory utilization (0.45, 62.91 GiB). Decrease GPU memory utilization or "
        "reduce GPU memory used by other processes.",
    "start-up: no memory for the KV cache":
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
    "torch out of memory":
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 139.81 GiB of which 1.20 GiB is free.",
}


# --- vLLM's lines -----------------------------------------------------------------------
def test_vllm_lines_give_the_kv_cache_sleeps_and_wake_ups():
    got = drv.parse_vllm_lines(SAMPLES)
    assert got["kv_cache_bytes"] == int(1.02 * GIB)
    assert (got["kv_cache_tokens"], got["max_model_len"], got["max_concurrency"]) == \
        (10880, 2048, 5.31)
    assert got["sleeps"] == [{"freed_gib": 2.65, "in_use_gib": 63.2},
                             {"freed_gib": 2.61, "in_use_gib": 63.24}]
    assert got["wakes"] == [{"seconds": 0.412345, "tags": "['weights']"},
                            {"seconds": 0.098765, "tags": "['kv_cache']"}]
    assert drv.parse_vllm_lines(["nothing of vLLM's"])["kv_cache_tokens"] is None


@pytest.mark.parametrize("kind", sorted(OOM_SAMPLES))
def test_each_out_of_memory_line_is_named(kind):
    lines = SAMPLES[:3] + ["Traceback (most recent call last):", OOM_SAMPLES[kind]]
    assert drv.failure_line(lines) == {"kind": kind, "line": OOM_SAMPLES[kind]}


def test_no_out_of_memory_line_is_none():
    assert drv.failure_line(SAMPLES + ["RuntimeError: NCCL error: unhandled system error"]) is None


# --- the orchestrator's arithmetic --------------------------------------------------------
PROBE = {"ranks_on_gpu": 2, "gpu_total_bytes": 140 * GIB, "kv_cache_bytes": 39 * GIB,
         "min_free_generating": 42 * GIB, "min_free_training": 120 * GIB}


def test_edge_plan_gives_the_kv_target_and_the_slack():
    plan = drv.edge_plan(PROBE, kv_target_gib=1.0, slack_gib=0.5, probe_share=0.3)
    share, ballast = plan["share"], plan["ballast_gib"] * GIB
    assert plan["set_by"] == "the KV target" and plan["ranks_on_gpu"] == 2
    assert share == round(share, 4) and 0 < share < 0.3
    kv = 39 * GIB + (share - 0.3) * 140 * GIB
    assert abs(kv - 1 * GIB) < 0.02 * GIB and abs(plan["expected_kv_gib"] - kv / GIB) < 1e-3
    generating = 42 * GIB - 2 * (share - 0.3) * 140 * GIB - 2 * ballast
    assert 0.5 * GIB - 0.01 * GIB < generating < 0.5 * GIB + 0.04 * GIB  # share rounded down
    assert 120 * GIB - 2 * ballast >= 1 * GIB


def test_edge_plan_reads_the_gpus_lowest_reading_of_either_phase_as_moving_with_the_share():
    """Session I's probe (one H100, two ranks, share 0.3): the lowest reading while
    training equalled the one while generating (the other rank was generating). The
    old plan took it as training alone and gave 8.1 GiB of ballast a rank, which left
    47-56 GB free at the edge share; both readings move with the share."""
    probe = {"ranks_on_gpu": 2, "gpu_total_bytes": 85017493504,
             "kv_cache_bytes": int(22.68 * GIB), "min_free_generating": 18459721728,
             "min_free_training": 18459721728}
    plan = drv.edge_plan(probe, kv_target_gib=1.0, slack_gib=0.5, probe_share=0.3)
    assert plan["share"] == 0.0261
    left = 18459721728 - 2 * (0.0261 - 0.3) * 85017493504 - 2 * plan["ballast_gib"] * GIB
    assert 0.5 * GIB <= left < 0.6 * GIB and plan["ballast_gib"] > 30


def test_calibration_moves_the_ballast_by_what_the_run_left_over_the_slack():
    plan = {"share": 0.0261, "ballast_gib": 8.096, "ranks_on_gpu": 2}
    got = drv.calibrated(plan, {"min_free_generating": 47 * GIB, "min_free_training": None}, 0.5)
    assert got["ballast_gib"] == 31.346 and got["planned_ballast_gib"] == 8.096
    assert drv.calibrated(plan, {"min_free_generating": 0}, 0.5)["ballast_gib"] == 7.846
    # the run's own ballast is the basis (it ran with room to spare)
    assert drv.calibrated(plan, {"min_free_generating": int(2.5 * GIB), "ballast_gib": 7.096},
                          0.5)["ballast_gib"] == 8.096
    assert drv.calibrated(dict(plan, ballast_gib=0.1), {"min_free_training": 0},
                          2.0)["ballast_gib"] == 0.0  # never negative
    with pytest.raises(ValueError, match="no free-memory reading"):
        drv.calibrated(plan, {"min_free_generating": None}, 0.5)


def test_a_calibration_out_of_memory_runs_again_with_twice_the_room_then_stops():
    state = {"runs": {"probe": dict(PROBE, ok=True)}}
    first = drv.plan_runs(state, plan_args())[0]
    planned = state["edge"]["ballast_gib"]
    # 2 GiB more of the GPU left free, shared by its 2 ranks
    assert first["ballast_gib"] == int((planned - 1.0) * 1000) / 1000
    oom = {"kind": "torch", "line": "CUDA out of memory. Tried to allocate 2.00 MiB"}
    state["runs"]["calibrate"] = dict(first, ok=False, failed={"oom": oom})
    again = drv.plan_runs(state, plan_args())[0]
    assert again["name"] == "calibrate"
    assert again["ballast_gib"] == int((planned - 2.0) * 1000) / 1000
    assert [r["ballast_gib"] for r in state["failed_calibrations"]] == [first["ballast_gib"]]
    state["runs"]["calibrate"] = dict(again, ok=False, failed={"oom": oom})
    third = drv.plan_runs(state, plan_args())[0]
    assert third["ballast_gib"] == int((planned - 4.0) * 1000) / 1000
    state["runs"]["calibrate"] = dict(third, ok=False, failed={"oom": oom})
    with pytest.raises(SystemExit, match="larger --slack-gib"):
        drv.plan_runs(state, plan_args())
    # a failure that is not out of memory is not a matter of room: it stops at once
    state = {"runs": {"probe": dict(PROBE, ok=True)}}
    drv.plan_runs(state, plan_args())
    state["runs"]["calibrate"] = {"ok": False, "ballast_gib": 1.0, "failed": {"oom": None}}
    with pytest.raises(SystemExit, match="larger --slack-gib"):
        drv.plan_runs(state, plan_args())


def test_a_failed_run_reads_as_its_out_of_memory_line_else_its_errors():
    assert drv.failure_text({"oom": {"kind": "torch", "line": "CUDA out of memory"}}, 1) \
        == "torch: CUDA out of memory"
    assert drv.failure_text({"oom": None, "errors": {0: "RuntimeError: x"}}, 1) == "RuntimeError: x"
    assert drv.failure_text(None, -9) == "rc -9"


def test_edge_plan_without_room_for_a_ballast_sets_the_share_by_the_slack():
    probe = dict(PROBE, min_free_generating=3 * GIB)
    plan = drv.edge_plan(probe, kv_target_gib=60.0, slack_gib=0.5, probe_share=0.3)
    assert plan["ballast_gib"] == 0 and "the slack" in plan["set_by"]
    assert plan["share"] == int((0.3 + 2.5 / 280) * 10**4) / 10**4


def test_edge_plan_refuses_a_probe_without_its_figures_and_a_share_that_cannot_fit():
    with pytest.raises(ValueError, match="did it run two generations"):
        drv.edge_plan(dict(PROBE, min_free_generating=None), 1.0, 0.5)
    with pytest.raises(ValueError, match="no share fits"):
        drv.edge_plan(dict(PROBE, min_free_generating=0), 60.0, 0.5, probe_share=0.001)


def test_raised_shares_are_the_headroom_line_and_the_per_rank_figure():
    from amem_callbacks.headroom import DEFAULT_MARGIN_BYTES

    amem = {"headroom_suggested": 0.04, "gpu_total_bytes": 140 * GIB,
            "nccl_bytes": int(1.15 * GIB)}
    got = drv.raised_shares(amem, 0.0286)
    assert got["headroom"] == 0.04
    assert got["per_rank"] == int((0.0286 + (int(1.15 * GIB) - DEFAULT_MARGIN_BYTES)
                                   / (140 * GIB)) * 10**4) / 10**4 == 0.0332
    assert drv.raised_shares({"headroom_suggested": None}, 0.3) == {"headroom": None,
                                                                   "per_rank": None}


def plan_args(**kw):
    base = dict(share=None, ballast_gib=0.0, probe_share=0.3, kv_target_gib=1.0, slack_gib=0.5,
                pairs=2, raised_pairs=1, search_step=None, search_high=None)
    return argparse.Namespace(**dict(base, **kw))


def test_the_plan_probes_then_runs_abba_pairs_then_the_raised_shares_without_first():
    state = {}
    assert [r["name"] for r in drv.plan_runs(state, plan_args())] == ["probe"]
    state["runs"] = {"probe": dict(PROBE, ok=True)}
    todo = drv.plan_runs(state, plan_args())  # the plan's own run first, package off
    assert [(r["name"], r["amem"]) for r in todo] == [("calibrate", False)]
    planned = state["edge"]["ballast_gib"]
    # the calibration leaves 2 GiB more room than the plan (1 GiB a rank)
    assert (todo[0]["share"], todo[0]["ballast_gib"]) == (state["edge"]["share"],
                                                          int((planned - 1.0) * 1000) / 1000)
    # at the plan's ballast it would have left 2.5 GiB free at the GPU's fullest, not
    # the 0.5 asked: 1 GiB more a rank than planned
    state["runs"]["calibrate"] = {"ok": True, "min_free_generating": int(4.5 * GIB),
                                  "min_free_training": 9 * GIB, "ballast_gib": planned - 1.0}
    todo = drv.plan_runs(state, plan_args())
    assert state["edge"]["ballast_gib"] == int((planned + 1.0) * 1000) / 1000
    assert state["edge"]["planned_ballast_gib"] == planned
    assert state["edge"]["calibration_min_free_gib"] == 4.5
    assert [r["name"] for r in todo] == ["default-amem-0", "default-base-0", "default-base-1",
                                         "default-amem-1"]
    assert len({r["share"] for r in todo}) == 1 and state["edge"]["share"] == todo[0]["share"]
    assert todo[0]["ballast_gib"] == state["edge"]["ballast_gib"] > 0
    default = todo[0]["share"]
    state["runs"]["default-amem-0"] = {"ok": True, "headroom_suggested": 0.04,
                                       "gpu_total_bytes": 140 * GIB, "nccl_bytes": int(1.15 * GIB)}
    todo = drv.plan_runs(state, plan_args())
    names = [r["name"] for r in todo]
    assert names == ["default-base-0", "raised_headroom-base-0", "raised_headroom-amem-0",
                     "raised_per_rank-base-0", "raised_per_rank-amem-0",
                     "default-base-1", "default-amem-1"]
    assert state["shares"] == {"default": default, "raised_headroom": 0.04,
                               "raised_per_rank": drv.raised_shares(
                                   state["runs"]["default-amem-0"], default)["per_rank"]}
    # the headroom line suggested no raise: only the per-rank figure is tried
    state["runs"]["default-amem-0"]["headroom_suggested"] = default
    assert not [r for r in drv.plan_runs(state, plan_args()) if "headroom" in r["name"]]


def test_the_search_finds_the_largest_share_without_then_with_then_pairs_them():
    """The yardstick (issue 59): on one grid from the default share, the largest share
    that runs without the package (bisected; an out-of-memory run is a failure, a run
    cut without one is tried again), then the largest with it, then ABBA pairs."""
    oom = {"oom": {"kind": "cuMem out of memory (sleep-mode wake-up)", "line": "out of memory"}}
    args = plan_args(share=0.027, ballast_gib=29.476, search_step=0.0039, search_high=0.0465)
    state = {"runs": {}}
    # without the package, the grid's middle first: 0.0348 fits, 0.0426 fails, 0.0387 is
    # cut once, then fails. With it, from 0.0348 on the same grid: up to 0.0426 fits.
    without = {0.0348: [True], 0.0426: [False], 0.0387: [None, False]}
    with_ = {0.0387: [True], 0.0426: [True], 0.0465: [False]}
    order = []
    while True:
        todo = drv.plan_runs(state, args)
        run = todo[0]
        if not run["name"].startswith("search-"):
            break
        order.append(run["name"])
        assert run["ballast_gib"] == 29.476 and run["variant"] in ("search_base", "search_amem")
        outcomes = with_ if run["amem"] else without
        fits = outcomes[run["share"]].pop(0)
        state["runs"][run["name"]] = dict(run, ok=fits is True,
                                          failed=None if fits else (oom if fits is False else
                                                                    {"oom": None}))
    assert order == ["search-base-0.0348", "search-base-0.0426", "search-base-0.0387",
                     "search-base-0.0387-1",
                     "search-amem-0.0387", "search-amem-0.0426", "search-amem-0.0465"]
    assert state["search"]["base"]["largest_fit"] == 0.0348
    assert state["search"]["base"]["smallest_fail"] == 0.0387
    assert state["search"]["amem"]["largest_fit"] == 0.0426
    assert [(r["name"], r["share"]) for r in todo] == [
        ("raised-amem-0", 0.0426), ("best-base-0", 0.0348), ("best-base-1", 0.0348),
        ("raised-amem-1", 0.0426)]
    assert drv.summarise(state)["search"]["base"]["trials"]["0.0387"] == [None, False]


def test_a_search_that_cannot_tell_stops_and_says_why():
    args = plan_args(share=0.027, ballast_gib=1.0, search_step=0.004, search_high=0.035)
    state = {"runs": {"search-base-0.027": {"share": 0.027, "ok": False, "failed": {"oom": {}}}}}
    state["runs"]["search-base-0.027"]["failed"]["oom"] = {"line": "out of memory"}
    with pytest.raises(SystemExit, match="lowest setting 0.027 does not fit"):
        drv.plan_runs(state, args)


def test_the_plan_follows_the_headroom_line_while_the_share_before_still_fitted():
    state = {"runs": {"probe": dict(PROBE, ok=True)}}
    drv.plan_runs(state, plan_args())
    state["runs"]["calibrate"] = {"ok": True, "min_free_generating": int(1.5 * GIB)}
    drv.plan_runs(state, plan_args(raised_pairs=1, pairs=1))
    amem = {"ok": True, "gpu_total_bytes": 80 * GIB, "nccl_bytes": int(1.125 * GIB)}
    state["runs"].update({"default-amem-0": dict(amem, headroom_suggested=0.0339),
                          "default-base-0": {"ok": True}})
    names = lambda: [r["name"] for r in drv.plan_runs(state, plan_args(raised_pairs=1, pairs=1))]
    assert names()[:2] == ["raised_headroom-base-0", "raised_headroom-amem-0"]
    # both fitted: the package's run there recommends the next step
    state["runs"]["raised_headroom-base-0"] = {"ok": True}
    state["runs"]["raised_headroom-amem-0"] = dict(amem, headroom_suggested=0.0417)
    assert names()[:2] == ["raised_headroom_2-base-0", "raised_headroom_2-amem-0"]
    assert state["shares"]["raised_headroom_2"] == 0.0417
    # the second step failed without the package: the edge is found, no third step
    state["runs"]["raised_headroom_2-base-0"] = {"ok": False, "failed": {"oom": {"kind": "x"}}}
    state["runs"]["raised_headroom_2-amem-0"] = dict(amem, headroom_suggested=0.05)
    assert not [n for n in names() if n.startswith("raised_headroom_3")]
    # at most HEADROOM_STEPS steps, however far the line goes on fitting
    for step in range(2, drv.HEADROOM_STEPS + 2):
        variant = f"raised_headroom_{step}"
        state["runs"][f"{variant}-base-0"] = {"ok": True}
        state["runs"][f"{variant}-amem-0"] = dict(amem, headroom_suggested=0.04 + step / 100)
    assert not [n for n in names() if n.startswith(f"raised_headroom_{drv.HEADROOM_STEPS + 1}")]


def test_the_verdict_is_the_first_headroom_step_that_did_not_fit_without_the_package():
    oom = {"kind": "cuMem out of memory (sleep-mode wake-up)", "line": "CUDA Error: out of memory"}
    state = {"shares": {"default": 0.0261, "raised_headroom": 0.0339, "raised_headroom_2": 0.0417},
             "runs": {"default-base-0": run_row("default", False),
                      "raised_headroom-base-0": run_row("raised_headroom", False),  # fitted
                      "raised_headroom-amem-0": run_row("raised_headroom", True),
                      "raised_headroom_2-base-0": run_row("raised_headroom_2", False, ok=False,
                                                          failed={"oom": oom}),
                      "raised_headroom_2-amem-0": run_row("raised_headroom_2", True)}}
    got = drv.summarise(state)
    assert got["raised_share_fails_without"] is True
    assert got["raised_share"] == {"variant": "raised_headroom_2", "share": 0.0417,
                                   "runs_with": True, "failure_lines": [oom]}
    assert [(h["variant"], h["fails_without"]) for h in got["headroom_steps"]] == [
        ("raised_headroom", False), ("raised_headroom_2", True)]
    del state["runs"]["raised_headroom_2-base-0"], state["runs"]["raised_headroom_2-amem-0"]
    got = drv.summarise(state)  # every step tried fitted without it
    assert got["raised_share_fails_without"] is False
    assert got["raised_share"]["variant"] == "raised_headroom"
    assert drv.headroom_variants(["raised_headroom_10", "raised_headroom_2", "raised_headroom",
                                  "raised_per_rank"]) == [
        "raised_headroom", "raised_headroom_2", "raised_headroom_10"]


def test_the_plan_with_a_given_share_skips_the_probe():
    todo = drv.plan_runs({}, plan_args(share=0.25, ballast_gib=3.0, pairs=1))
    assert [(r["name"], r["share"], r["ballast_gib"]) for r in todo] == [
        ("default-amem-0", 0.25, 3.0), ("default-base-0", 0.25, 3.0)]


def run_row(variant, amem, ok=True, **kw):
    row = {"variant": variant, "amem": amem, "ok": ok, "share": kw.pop("share", 0.03),
           "kv_cache_tokens": 10000, "kv_cache_bytes": GIB, "tokens_per_s": 1000.0,
           "mean_step_s": 2.0, "generation_step_s": 5.0, "loss": [0.1, 0.2], "failed": None}
    row.update(kw)
    return row


def test_the_summary_says_whether_the_raised_share_fails_without_the_package():
    oom = {"kind": "cuMem out of memory (sleep-mode wake-up)", "line": "CUDA Error: out of memory at"}
    state = {"shares": {"default": 0.03, "raised_headroom": 0.04, "raised_per_rank": 0.0332},
             "runs": {
                 "default-amem-0": run_row("default", True),
                 "default-base-0": run_row("default", False, loss=[0.1, 0.25]),
                 "raised_headroom-base-0": run_row("raised_headroom", False, ok=False,
                                                   failed={"oom": oom}, kv_cache_tokens=None),
                 "raised_headroom-amem-0": run_row("raised_headroom", True, share=0.04,
                                                   kv_cache_tokens=15000, tokens_per_s=1300.0,
                                                   generation_torch_peak_bytes=3 * GIB // 2,
                                                   generation_free_drop_bytes=GIB // 4),
                 "raised_per_rank-base-0": run_row("raised_per_rank", False),  # fitted anyway
             }}
    got = drv.summarise(state)
    assert got["raised_share_fails_without"] is True
    assert got["raised_share_fails_without_by_variant"] == {"raised_headroom": True,
                                                            "raised_per_rank": False}
    assert got["raised_share_runs_with"] == {"raised_headroom": True, "raised_per_rank": None}
    assert got["failure_lines"]["raised_headroom"] == [oom]
    row = got["variants"]["raised_headroom"]["raised_headroom-amem-0"]
    assert row["vs_default_without"]["kv_cache_tokens"] == 1.5
    assert row["vs_default_without"]["tokens_per_s"] == 1.3
    assert (row["generation_peak_gib"], row["generation_drop_gib"]) == (1.5, 0.25)
    assert got["variants"]["default"]["default-amem-0"]["generation_peak_gib"] is None
    assert got["max_loss_difference_at_one_share"]["default"] == pytest.approx(0.05)
    # a raised run without the package that died for another reason is no OOM verdict
    state["runs"]["raised_headroom-base-0"]["failed"] = {"oom": None, "hung": True}
    assert drv.summarise(state)["raised_share_fails_without"] is False
    assert drv.summarise({"runs": {}})["raised_share_fails_without"] is None


def test_step_figures_give_the_whole_run_then_the_steady_state_without_the_first_cycle():
    got = drv.step_figures([9.0, 1.0, 5.0, 1.2, 6.0, 1.4], steps_per_generation=2)
    assert got == pytest.approx({"whole_run_mean_step_s": 23.6 / 6, "generation_step_s": 5.5,
                                 "train_step_s": 1.3, "mean_step_s": 3.4})


def write_ranks(prefix: str, ranks: dict) -> None:
    for rank, body in ranks.items():
        with open(f"{prefix}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "failed": None, **body}, f)


def test_the_merged_whole_run_figures_count_every_ranks_warm_up(tmp_path):
    """The headline figures of a run: the slowest rank's start to last step and mean
    step over every step, tokens over every generation's seconds: a merge that left
    the first generation out (its compilation, the first begin) would read faster."""
    prefix = str(tmp_path / "rank")
    steps = {0: [9.0, 1.0, 2.0, 1.0], 1: [12.0, 1.0, 2.0, 1.0]}
    generations = [{"tokens": 100, "generate_s": 10.0, "tokens_per_s": 10.0},
                   {"tokens": 300, "generate_s": 1.0, "tokens_per_s": 300.0}]
    write_ranks(prefix, {rank: {
        "commit": "c" * 40, "whole_run_s": 60.0 + rank, "loss": [0.1] * 4,
        "generations": generations, **drv.step_figures(seconds, steps_per_generation=2),
        "whole_run_tokens_per_s": drv.whole_run_tokens_per_s(generations)}
        for rank, seconds in steps.items()})
    run = drv.merge_run(prefix, meta={"ranks": 2, "rc": 0})
    assert run["whole_run_s"] == 61.0
    assert run["whole_run_mean_step_s"] == pytest.approx(16.0 / 4)  # rank 1's, step 0 in
    assert run["whole_run_tokens_per_s"] == pytest.approx(400 / 11.0)
    assert run["mean_step_s"] == pytest.approx(1.5)  # the steady state, said as such
    assert run["tokens_per_s"] == pytest.approx(300.0)
    assert run["commit"] == "c" * 40


def test_a_merge_refuses_ranks_or_runs_of_different_commits(tmp_path):
    from amem_callbacks.tools.pairs import MixedCommits
    from tests.gpu import vllm_series_merge

    prefix = str(tmp_path / "rank")
    write_ranks(prefix, {0: {"commit": "a" * 40}, 1: {"commit": "b" * 40}})
    with pytest.raises(MixedCommits, match="not made by one commit"):
        drv.merge_run(prefix, meta={"ranks": 2, "rc": 0})
    # a series folded into a results folder whose runs came from another commit
    for name, commit in (("best-base-0", "a" * 40), ("raised-amem-0", "b" * 40)):
        folder = tmp_path / "series" / name
        folder.mkdir(parents=True)
        (folder / "log.txt").write_text("ran\n")
        (folder / "rc.txt").write_text("0 100\n")
        write_ranks(str(folder / "rank"), {r: {
            "commit": commit, "world": 2, "args": {"share": 0.03, "amem": "amem" in name,
                                                  "steps": 2},
            "loss": [0.1, 0.1]} for r in (0, 1)})
    results = tmp_path / "results"
    with pytest.raises(MixedCommits, match="--mixed-commits-why"):
        vllm_series_merge.fold(str(results), [str(tmp_path / "series")], "session T t1")
    assert not results.joinpath("state.json").exists()  # nothing half-written
    summary = vllm_series_merge.fold(str(results), [str(tmp_path / "series")], "session T t1",
                                     mixed_commits_why="a comment changed between them")
    assert json.load(open(results / "state.json"))["mixed_commits"] == {
        "session T t1": "a comment changed between them"}
    # and the pair itself does not count: the two sides ran different code
    assert [(p["with"], p["without"], p["same_commit"], p["counts"])
            for p in summary["pairs"]["raised"]["pairs"]] == [
        ("raised-amem-0", "best-base-0", False, False)]


# --- CPU runs: the driver's own code on trl's real classes -----------------------------------
def cpu_env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", **{common.CPU_ENV: "1"})
    env.pop("AMEM_TEST_MUTATE", None)
    return env


def start_ranks(prefix: str, flags: list, work: str) -> list:
    """Two ranks of ``run`` with torchrun's variables, no torchrun."""
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(cpu_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(f"{prefix}.{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, DRIVER, "run", prefix, *flags, *TINY,
                                       "--work", work], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait_all(procs: list) -> list:
    deadline = time.monotonic() + LIMIT_S
    for p in procs:
        try:
            p.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
    return [p.wait() for p in procs]


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory, fake_nccl_dir):
    """The orchestrator (one pair at share 0.25, through torchrun) and, beside it, a run
    at a share the stand-in's device cannot hold (refused at start-up), started together
    (two cores)."""
    from tests.requires import skip_unless_installed

    skip_unless_installed("trl")  # the driver's ranks run TRL's GRPOTrainer on the stand-in vLLM
    tmp = tmp_path_factory.mktemp("trl-vllm")
    state, out = str(tmp / "state"), str(tmp / "out")
    orchestrator = subprocess.Popen(
        [sys.executable, DRIVER, "pairs", "--state", state, "--out", out, "--share", "0.25",
         "--pairs", "1", "--raised-pairs", "1", "--run-timeout-s", "400", "--budget-s", "480",
         *TINY], cwd=ROOT, env=cpu_env(), stdout=open(tmp / "pairs.log", "w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    refused = start_ranks(str(tmp / "refused"), ["--share", "0.6", "--amem"], str(tmp / "work"))
    codes = {"pairs": wait_all([orchestrator])[0], "refused": wait_all(refused)}
    return {"tmp": tmp, "state": state, "out": out, "codes": codes}


def log_of(res, name: str) -> str:
    return open(res["tmp"] / name, errors="replace").read()[-8000:]


def rank_json(res, run: str, rank: int) -> dict:
    with open(os.path.join(res["state"], "runs", run, f"rank.rank{rank}.json")) as f:
        return json.load(f)


def test_the_orchestrator_runs_the_pair_in_order_and_writes_the_summary(cpu_runs):
    assert cpu_runs["codes"]["pairs"] == 0, log_of(cpu_runs, "pairs.log")
    summary = json.load(open(os.path.join(cpu_runs["out"], "summary.json")))
    runs = json.load(open(os.path.join(cpu_runs["out"], "runs.json")))
    assert list(runs) == ["default-amem-0", "default-base-0"]  # ABBA's first pair: A first
    assert all(r["ok"] for r in runs.values()), {n: r.get("failed") for n, r in runs.items()}
    assert summary["runs_done"] == ["default-amem-0", "default-base-0"]
    import tarfile  # every run's log and rank JSON, not the model folders

    with tarfile.open(os.path.join(cpu_runs["out"], "logs.tgz")) as tar:
        assert sorted(tar.getnames()) == [f"{run}/{leaf}" for run in ("default-amem-0",
                                          "default-base-0") for leaf in (
                                          "log.txt", "rank.rank0.json", "rank.rank1.json")]
    assert sorted(os.listdir(cpu_runs["out"])) == ["logs.tgz", "runs.json", "state.json",
                                                   "summary.json"]
    assert summary["runs_planned_next"] == []
    # on CPU the package knows no GPU total, so there is no raised share to try
    assert summary["shares"] == {"default": 0.25, "raised_headroom": None, "raised_per_rank": None}
    assert summary["raised_share_fails_without"] is None
    # common.provenance: the orchestrator's command (the one typed), the commit
    assert summary["commit"] == common.run_commit(ROOT)
    assert summary["command"].split()[1:4] == [DRIVER, "pairs", "--state"]
    assert summary["env"][common.CPU_ENV] == "1"
    for name, run in runs.items():
        assert re.search(r"torch\.distributed\.run --nproc-per-node 2 --master-port \d+ "
                         + re.escape(DRIVER) + r" run \S+ --share 0\.25 --"
                         + ("amem" if run["amem"] else "no-amem"), run["command"])
        assert run["commit"] == run["git_head"] == common.run_commit(ROOT)
        assert run["kv_cache_tokens"] == (int(0.25 * 80 * GIB) - 2 * GIB) // 4096
        row = summary["variants"]["default"][name]
        assert row["vs_default_without"]["kv_cache_tokens"] == 1.0


def test_trl_syncs_weights_then_the_begin_comes_before_the_kv_wake_up_and_the_end_after_sleep(
        cpu_runs):
    """trl 1.16's own order under the callback: its weight sync wakes vLLM's weights
    with every group active; the begin (its suspends waited for) comes before vLLM
    maps its KV cache; the end (the first accelerator gather) after vLLM slept."""
    per_generation = [("sync_weights", None), ("wake_up", ["weights"]), ("begin", None),
                      ("wake_up", ["kv_cache"]), ("generate", None), ("sleep", 2), ("end", None)]
    for rank in range(2):
        got = [(e["what"], e.get("tags", e.get("level"))) for e in
               rank_json(cpu_runs, "default-amem-0", rank)["events"]]
        assert got == per_generation * 2
        base = [(e["what"], e.get("tags", e.get("level"))) for e in
                rank_json(cpu_runs, "default-base-0", rank)["events"]]
        assert base == [e for e in per_generation if e[0] not in ("begin", "end")] * 2


def test_each_rank_records_the_package_vllm_and_the_run(cpu_runs):
    for rank in range(2):
        got = rank_json(cpu_runs, "default-amem-0", rank)
        assert got["failed"] is None and got["rank"] == rank and got["world"] == 2
        amem = got["amem"]
        assert not amem["inert"] and len(amem["begins"]) == len(amem["ends"]) == 2
        for begin in amem["begins"]:
            actions = {g["name"]: g["action"] for g in begin["groups"]}
            assert actions["world"] == "suspended" and actions[drv.SYNC_ROLE] == "kept"
            assert begin["nccl_bytes"] > 0
        assert amem["counters"]["amem/total/auto_resumes"] == 0
        assert amem["waited"]["start"] > 0
        assert got["vllm"]["kv_cache_bytes"] == int(0.25 * 80 * GIB) - 2 * GIB
        assert len(got["vllm"]["sleeps"]) == 3  # after start-up, then after each generation
        gens = got["generations"]
        assert [g["step"] for g in gens] == [0, 2]
        assert all(g["tokens"] == 2 * 2 * 8 and g["sequences"] == 4 for g in gens)
        assert all(g["free_before_kv_wake"] == common.STAND_IN_MEMORY[0] for g in gens)
        assert all("sync_weights_s" in g and "wake_kv_s" in g and "sleep_s" in g for g in gens)
        # torch's peak counter read around generate (the stand-in counts nothing)
        assert all(g["torch_reserved_at_kv_wake"] == 0 == g["torch_peak_beyond_kv_wake"]
                   for g in gens)
        assert len(got["step_seconds"]) == 4 and len(got["loss"]) == 4
        assert got["mode"].startswith("cpu") and got["versions"]["trl"] == "1.16.0"
        assert re.fullmatch(r"[0-9a-f]{40}", got["git_head"])
        assert got["commit"] == got["git_head"] == common.run_commit(ROOT)
        # under torchrun: torchrun's own line, as the orchestrator ran it
        assert re.fullmatch(r"python[\d.]* -m torch\.distributed\.run --nproc-per-node 2 "
                            r"--master-port \d+ " + re.escape(DRIVER) + r" run \S+ --share "
                            r"0\.25 --amem .*", got["command"]), got["command"]
        assert got["env"][common.CPU_ENV] == "1"
        with open(os.path.join(ROOT, DRIVER), "rb") as f:
            assert got["code_sha256"][DRIVER] == hashlib.sha256(f.read()).hexdigest()
        assert got["args"]["share"] == 0.25 and got["args"]["amem"] is True
        # read when trl builds vllm.LLM (on a GPU: whether the default group's
        # communicator exists by then; on CPU torch has none to tell of)
        assert got["at_vllm_start"] == {"free_bytes": common.STAND_IN_MEMORY[0],
                                        "world_communicator": False, "why_not": "no CUDA device",
                                        "first_sleep_synced": True}
        assert rank_json(cpu_runs, "default-base-0", rank)["amem"] is None


def test_ranks_take_vllms_start_up_measurements_one_after_the_other(cpu_runs):
    """Rank 1 snapshots the free memory only once rank 0's profiling is over (what
    ranks sharing a GPU do; the CPU mode takes the same turns on the stand-in)."""
    for run in ("default-amem-0", "default-base-0"):
        first, second = (rank_json(cpu_runs, run, r)["vllm_turns"] for r in range(2))
        assert first["snapshot_at"] <= first["profiled_at"] <= second["snapshot_at"] \
            <= second["profiled_at"]


def test_a_share_the_device_cannot_hold_fails_at_start_up_with_vllms_line(cpu_runs):
    assert cpu_runs["codes"]["refused"] == [3, 3], log_of(cpu_runs, "refused.0.log")
    prefix = str(cpu_runs["tmp"] / "refused")
    for rank in range(2):
        with open(f"{prefix}.rank{rank}.json") as f:
            failed = json.load(f)["failed"]
        assert failed["stage"].startswith("start-up")
        assert failed["oom"]["kind"] == "start-up: free memory below the share"
        assert "(0.6, 48.0 GiB)" in failed["oom"]["line"]
    with open(f"{prefix}.rank0.json") as f:  # started without torchrun: its own command
        assert json.load(f)["command"].split()[1:3] == [DRIVER, "run"]
    run = drv.merge_run(prefix, meta={"ranks": 2, "rc": 1})
    assert not run["ok"] and run["failed"]["oom"]["kind"] == "start-up: free memory below the share"
    assert set(run["failed"]["stages"]) == {0, 1}


def test_merge_counts_a_rank_that_wrote_nothing_and_reads_its_line_from_the_log(cpu_runs, tmp_path):
    prefix = str(tmp_path / "rank")
    with open(os.path.join(cpu_runs["state"], "runs", "default-amem-0", "rank.rank0.json")) as f:
        rank0 = json.load(f)
    with open(f"{prefix}.rank0.json", "w") as f:
        json.dump(rank0, f)
    lines = ["[rank1]: RuntimeError: CUDA Error: out of memory at csrc/cumem_allocator.cpp:62"]
    run = drv.merge_run(prefix, lines, {"ranks": 2, "rc": -9, "hung": False})
    assert not run["ok"] and run["ranks_missing"] == [1]
    assert run["failed"]["oom"]["kind"] == "cuMem out of memory (sleep-mode wake-up)"
    assert run["kv_cache_bytes"] == rank0["vllm"]["kv_cache_bytes"]
    whole = drv.merge_run(os.path.join(cpu_runs["state"], "runs", "default-amem-0", "rank"),
                          meta={"ranks": 2, "rc": 0})
    assert whole["ok"] and whole["ranks_reported"] == [0, 1] and whole["nccl_bytes"] > 0
    assert whole["loss"] == rank0["loss"] and "cut_after_finishing" not in whole
    # the series' bound cut the launcher after every rank wrote all its steps: the run
    # stands, and says so; a rank short of its steps leaves it failed
    cut = drv.merge_run(os.path.join(cpu_runs["state"], "runs", "default-amem-0", "rank"),
                        meta={"ranks": 2, "rc": 124, "hung": True})
    assert cut["ok"] and cut["cut_after_finishing"] and cut["rc"] == 124
    with open(f"{prefix}.rank1.json", "w") as f:
        json.dump(dict(rank0, loss=rank0["loss"][:-1]), f)
    assert not drv.merge_run(prefix, meta={"ranks": 2, "rc": 124})["ok"]
    # a run that wrote no rank JSON at all (the series' merge gives no world size) is no
    # good run (session N's cut runs read "ok" before)
    assert not drv.merge_run(str(tmp_path / "none" / "rank"))["ok"]


def test_a_tree_that_is_not_pip_installed_is_told_to_install_it():
    """The GPU scripts run on the installed package, no module splice: a bare copy
    of the tree (the editable install's finder taken away here) stops with the one
    install command."""
    script = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from tests.gpu.trl_vllm_gpu import import_callback\n"
        "import_callback()\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(cpu_env(), PYTHONPATH=""))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pip install --no-deps --no-build-isolation -e ." in done.stderr


def test_a_failed_probe_stops_the_orchestrator_with_its_error_and_comes_back_for_another_try(
        tmp_path, monkeypatch, capsys):
    """The first device run: the probe failed at start-up, and the orchestrator then
    died on edge_plan's ValueError with runs.json empty. Now it stops with the error,
    the failed run's log comes back, and the same command tries the probe again."""
    def fake_start(spec, args, folder, env):
        os.makedirs(folder, exist_ok=True)
        for rank in range(2):
            with open(os.path.join(folder, f"rank.rank{rank}.json"), "w") as f:
                json.dump({"rank": rank, "failed": {
                    "stage": "start-up (GRPOTrainer: vllm.LLM)", "oom": None,
                    "error": "ModuleNotFoundError: No module named 'flashinfer'"}}, f)
        log_path = os.path.join(folder, "log.txt")
        with open(log_path, "w") as f:
            f.write("rank 0: FAILED in start-up: ModuleNotFoundError: No module named "
                    "'flashinfer'\n")
        return None, ["torchrun", "probe"], log_path, open(os.devnull, "w")

    monkeypatch.setattr(drv, "start_run", fake_start)
    monkeypatch.setattr(drv, "wait_run", lambda proc, folder, timeout_s: (1, False))
    monkeypatch.setattr(common, "provenance", lambda driver: {"commit": "test"}, raising=False)
    state, out = str(tmp_path / "state"), str(tmp_path / "out")
    argv = ["pairs", "--state", state, "--out", out, "--budget-s", "600"]
    assert drv.main(argv) == 1
    printed = capsys.readouterr().out
    assert "stopping: the probe failed" in printed and "No module named 'flashinfer'" in printed
    runs = json.load(open(os.path.join(out, "runs.json")))
    assert not runs["probe"]["ok"]
    import tarfile  # the failed run's log and rank files come back in one archive

    with tarfile.open(os.path.join(out, "logs.tgz")) as tar:
        assert sorted(tar.getnames()) == ["probe/log.txt", "probe/rank.rank0.json",
                                          "probe/rank.rank1.json"]
    assert runs["probe"]["failed"]["errors"]["0"].startswith("ModuleNotFoundError")
    assert "probe" not in json.load(open(os.path.join(state, "state.json")))["runs"]
    assert drv.main(argv) == 1  # the same command: the probe again, not edge_plan's error
    assert "run probe:" in capsys.readouterr().out
    # an earlier probe on another GPU (here: none, on CPU) does not stand in
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"runs": {"probe": dict(PROBE, ok=True, versions={})}}))
    assert drv.main(argv + ["--probe-from", str(earlier)]) == 1
    printed = capsys.readouterr().out
    assert "--probe-from" in printed and "probing" in printed and "run probe:" in printed


def test_an_earlier_probe_stands_in_only_on_the_same_gpu_and_versions(tmp_path):
    now = {"torch": "2.13.0", "vllm": "0.31.0", "trl": "1.16.0"}
    earlier = tmp_path / "state.json"
    earlier.write_text(json.dumps({"estimate_s": 201.0, "runs": {"probe": dict(
        PROBE, ok=True, versions=dict(now, transformers="5.17.0"))}}))
    state = {}
    assert "stands for this one" in drv.seed_probe(state, str(earlier), 140 * GIB, now)
    assert state["runs"]["probe"]["probe_from"] == str(earlier)
    assert state["estimate_s"] == 201.0
    assert drv.plan_runs(state, plan_args())[0]["name"] == "calibrate"  # no probe run
    for total, versions in ((80 * GIB, now), (140 * GIB, dict(now, vllm="0.30.0")),
                            (None, now)):
        state = {}
        assert "probing" in drv.seed_probe(state, str(earlier), total, versions)
        assert state == {}
    assert "not read" in drv.seed_probe({}, str(tmp_path / "none.json"), 140 * GIB, now)
    # another workload (more sequences a generation) probes afresh
    ran = ["--steps", "12", "--batch", "4", "--gradient-checkpointing"]
    earlier.write_text(json.dumps({"runs": {"probe": dict(
        PROBE, ok=True, versions=now, command="python3 -m torch.distributed.run x.py run p "
                                              + " ".join(ran) + " --git-head abc")}}))
    state = {}
    assert "stands for this one" in drv.seed_probe(state, str(earlier), 140 * GIB, now, ran)
    state = {}
    assert "run flags differ" in drv.seed_probe(
        state, str(earlier), 140 * GIB, now, ["--steps", "24", "--batch", "8"])
    assert state == {}


def test_merge_gives_a_generations_torch_peak_beside_its_free_memory_drop(tmp_path):
    """What a generation needs beyond its KV wake-up at its peak (torch's counter) and
    what the free memory after generate shows, this rank's part of it where ranks
    share the GPU: the larger over the later generations of every rank (the first
    carries start-up's compilation and is left out)."""
    prefix = str(tmp_path / "rank")
    gens = {0: [(9 * GIB, 50, 40), (GIB, 50 * GIB, 49 * GIB), (2 * GIB, 50 * GIB, 47 * GIB)],
            1: [(9 * GIB, 50, 40), (3 * GIB, 50 * GIB, 48 * GIB)]}
    for rank, rows in gens.items():
        with open(f"{prefix}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "failed": None, "ranks_on_gpu": 2 if rank == 0 else None,
                       "generations": [{"torch_peak_beyond_kv_wake": peak,
                                        "free_after_kv_wake": wake, "free_after_generate": after}
                                       for peak, wake, after in rows]}, f)
    run = drv.merge_run(prefix, meta={"ranks": 2, "rc": 0})
    assert run["generation_torch_peak_bytes"] == 3 * GIB
    assert run["generation_free_drop_bytes"] == 2 * GIB  # rank 1's; rank 0's 3 GiB is 1.5 its own


LEAVES_A_RANK = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                        start_new_session=True)
open(sys.argv[1], "w").write(str(rank.pid))
time.sleep(float(sys.argv[2]))
"""


@pytest.mark.parametrize("cut_off", [False, True])
def test_a_run_is_ended_with_its_ranks_in_sessions_of_their_own(tmp_path, monkeypatch, cut_off):
    """On the GPU machine (session L) a failed run's ranks, which torchrun starts in
    sessions of their own, outlived the killpg of the run and held 78 GiB: the next two
    runs ran out of memory at their model build. Every process of a run carries its
    tag now and ends with it, whether the run ends by itself or is cut off; a process
    in another session stands in for a rank here, the run's own for torchrun."""
    captured = []
    monkeypatch.setattr(drv, "orchestrate", lambda args: captured.append(args) or 0)
    drv.main(["pairs", "--state", str(tmp_path)])
    pid_file = tmp_path / "rank.pid"
    real_popen, launched = drv.subprocess.Popen, []

    def torchrun_standin(argv, **kwargs):
        launched.append(argv)
        return real_popen([sys.executable, "-c", LEAVES_A_RANK, str(pid_file),
                           "120" if cut_off else "0.5"], **kwargs)

    monkeypatch.setattr(drv.subprocess, "Popen", torchrun_standin)
    spec = {"name": "leaves", "share": 0.1, "amem": False, "ballast_gib": 0.0}
    folder = str(tmp_path / "run")
    proc, argv, _log_path, log = drv.start_run(spec, captured[0], folder, dict(os.environ))
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    rank = int(pid_file.read_text())
    rc, hung = drv.wait_run(proc, folder, timeout_s=3 if cut_off else 60)
    log.close()
    assert "torch.distributed.run" in launched[0] and hung is cut_off
    assert rc == (-9 if cut_off else 0)
    assert not alive(rank)


def test_the_orchestrator_does_not_start_a_run_beside_processes_that_hold_the_gpu(
        tmp_path, monkeypatch, capsys):
    """No run is recorded as failed for memory a previous run left held: the
    orchestrator stops before it and names the holders."""
    started = []
    monkeypatch.setattr(drv, "start_run", lambda *a, **k: started.append(a))
    monkeypatch.setattr(drv, "wait_for_free_gpu", lambda wait_s=60: [(3717, 41021)])
    monkeypatch.setattr(common, "provenance", lambda driver: {"commit": "test"}, raising=False)
    state, out = str(tmp_path / "state"), str(tmp_path / "out")
    assert drv.main(["pairs", "--state", state, "--out", out, "--budget-s", "600"]) == 1
    assert not started
    printed = capsys.readouterr().out
    assert "still hold GPU memory" in printed and "3717" in printed and "probe" in printed
    assert json.load(open(os.path.join(out, "runs.json"))) == {}


def test_the_cpu_modes_runs_wait_for_no_gpu(monkeypatch):
    """On a GPU host the suite's own CUDA work holds GPU memory beside the CPU-mode
    orchestrator, whose runs use none: it must not stop for it."""
    monkeypatch.setattr(common, "ON_CPU", True)
    monkeypatch.setattr(drv, "gpu_holders", lambda: [(1, 518)])
    assert drv.wait_for_free_gpu(wait_s=0) == []
    monkeypatch.setattr(common, "ON_CPU", False)
    assert drv.wait_for_free_gpu(wait_s=0) == [(1, 518)]


def test_gpu_holders_reads_nvidia_smi_and_is_empty_without_it(monkeypatch):
    class Done:  # the orchestrator's own CUDA context (gpu_total_now) is not in the way
        returncode, stdout = 0, f"3717, 41021\n3718, 38701\n{os.getpid()}, 518\n"

    monkeypatch.setattr(drv.subprocess, "run", lambda *a, **k: Done())
    assert drv.gpu_holders() == [(3717, 41021), (3718, 38701)]

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(drv.subprocess, "run", missing)
    assert drv.gpu_holders() == []


def test_the_series_script_runs_merges_and_packs_each_run(tmp_path, fake_nccl_dir):
    """tests/gpu/vllm_series.sh (the hand runs of results/one_h100/trl_vllm_colocate_kv)
    on CPU: its run line, its merge and its archive, with a tiny workload; in the CPU
    mode it ends no GPU holder (on a GPU host the suite itself may be one)."""
    import tarfile

    from tests.requires import skip_unless_installed

    skip_unless_installed("trl")
    env = dict(cpu_env(), PYTHON=sys.executable, SERIES_PORT=str(free_port()),
               SERIES_RUN_S="400", SERIES_WORKLOAD=" ".join(TINY))
    done = subprocess.run(["bash", "tests/gpu/vllm_series.sh", str(tmp_path), "0" * 40,
                           "tiny-amem --share 0.25 --amem --short-wake 2:1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== tiny-amem rc=0" in done.stdout, done.stdout
    merged = json.load(open(tmp_path / "tiny-amem" / "merged.json"))
    assert merged["ok"] and merged["ranks_reported"] == [0, 1]
    rank1 = json.load(open(tmp_path / "tiny-amem" / "rank.rank1.json"))
    assert rank1["args"]["short_wake"] == [2, 1]
    # the CPU mode's begins never skip, so nothing was taken: the record says why
    assert rank1["generations"][1]["short_wake"]["why_not"].startswith("the begin ran")
    assert rank1["short_wake_ledger"] == []
    with tarfile.open(tmp_path / "series.tgz") as tar:
        names = tar.getnames()
    assert "./tiny-amem/rank.rank0.json" in names and "./tiny-amem/merged.json" in names
    assert "./tiny-amem/rc.txt" in names  # how the run ended, for the merge below
    assert not any("/work" in n for n in names)
    # the series folded into a results folder: the run's row carries its own arguments
    from tests.gpu import vllm_series_merge

    results = tmp_path / "results"
    summary = vllm_series_merge.fold(str(results), [str(tmp_path / "series.tgz")], "session T t1")
    row = json.load(open(results / "state.json"))["runs"]["tiny-amem"]
    assert (row["ok"], row["rc"], row["amem"], row["share"], row["variant"]) == (
        True, 0, True, 0.25, "tiny")
    assert row["series"] == "session T t1" and row["command"].startswith("python")
    assert summary["runs_done"] == ["tiny-amem"]
    with tarfile.open(results / "logs.tgz") as tar:
        assert "./tiny-amem/rank.rank1.json" in tar.getnames()
    with pytest.raises(SystemExit, match="a run named tiny-amem already"):
        vllm_series_merge.fold(str(results), [str(tmp_path / "series.tgz")], "session T t2")


def test_the_pairs_set_each_run_with_the_package_beside_its_pair_without_it():
    oom = {"kind": "cuMem out of memory (sleep-mode wake-up)", "line": "CUDA Error: out of memory"}
    runs = {"default-base-0": run_row("default", False, loss=[0.1] * 4),
            "default-amem-0": run_row("default", True, loss=[0.1] * 4, mean_step_s=2.2),
            "default-base-1": run_row("default", False, loss=[0.1] * 4, mean_step_s=2.5),
            "default-amem-1": run_row("default", True, loss=[0.1] * 4, ok=False),
            "raised-base-0": run_row("raised", False, ok=False, failed={"oom": oom}),
            "raised-amem-0": run_row("raised", True, loss=[0.1] * 4, mean_step_s=1.6,
                                     tokens_per_s=1500.0),
            "raised-amem-1": run_row("raised", True, loss=[0.1] * 3, mean_step_s=1.0),
            "raised-amem-2": run_row("raised", True, loss=[0.1] * 4)}  # no default-base-2
    got = drv.interleaved_pairs(runs)
    assert [(p["with"], p["without"], p["counts"]) for p in got["default"]["pairs"]] == [
        ("default-amem-0", "default-base-0", True)]  # a failed run with it pairs with none
    # the raised share's run without it failed, and these records have no search's
    # best share: the default share's is what it is set beside, and the pair says so
    assert [(p["with"], p["without"], p["counts"], p["against"])
            for p in got["raised"]["pairs"]] == [
        ("raised-amem-0", "default-base-0", True, "the default share (not the best without)"),
        ("raised-amem-1", "default-base-1", False, "the default share (not the best without)")]
    assert got["raised"]["counted"] == 1  # another step count is no pair
    assert got["raised"]["mean_step_s"] == {"median": 0.8, "min": 0.8, "max": 0.8}
    assert got["raised"]["tokens_per_s"]["median"] == 1.5
    assert got["default"]["mean_step_s"]["median"] == 1.1
    assert drv.summarise({"runs": runs})["pairs"] == got
    # with the search's largest share that ran without the package, that is the pair
    runs["best-base-0"] = run_row("best", False, loss=[0.1] * 4, mean_step_s=1.8, share=0.0348)
    got = drv.interleaved_pairs(runs)
    assert [(p["with"], p["without"], p["without_share"], p["against"])
            for p in got["raised"]["pairs"]][0] == (
        "raised-amem-0", "best-base-0", 0.0348, "the largest share that ran without")


def test_the_series_merge_leaves_out_a_run_cut_mid_training_and_keeps_a_failed_one(tmp_path):
    """A run the series' bound cut before it finished, with no out-of-memory line, says
    nothing about fitting (left out, with why); one that ran out of memory is a result."""
    from tests.gpu import vllm_series_merge

    def series_run(name, rc, loss_steps, failed=None):
        folder = tmp_path / "series" / name
        folder.mkdir(parents=True)
        (folder / "log.txt").write_text("starting\n")
        (folder / "rc.txt").write_text(f"{rc} 200\n")
        for rank in (0, 1):
            (folder / f"rank.rank{rank}.json").write_text(json.dumps({
                "world": 2, "command": "python3 -m torch.distributed.run ...",
                "args": {"share": 0.0426, "amem": "-amem-" in name,
                         "ballast_gib": 29.476, "steps": 48},
                "loss": [0.1] * loss_steps, "failed": failed if rank == 0 else None}))

    series_run("raised_headroom-amem-0", 124, 20)  # cut at step 20 of 48
    series_run("raised_headroom-base-0", 1, 16, failed={
        "stage": "generate", "error": "RuntimeError: CUDA Error: out of memory",
        "oom": {"kind": "cuMem out of memory (sleep-mode wake-up)",
                "line": "CUDA Error: out of memory at cumem_allocator.cpp:163"}})
    results = tmp_path / "results"
    summary = vllm_series_merge.fold(str(results), [str(tmp_path / "series")], "session T t1")
    state = json.load(open(results / "state.json"))
    assert list(state["runs"]) == ["raised_headroom-base-0"]
    assert state["runs"]["raised_headroom-base-0"]["variant"] == "raised_headroom"
    assert state["shares"] == {"raised_headroom": 0.0426}
    assert list(state["left_out"]) == ["session T t1: raised_headroom-amem-0"]
    assert state["left_out"]["session T t1: raised_headroom-amem-0"].startswith("cut at 200.0 s")
    assert summary["raised_share_fails_without"] is True
    assert summary["failure_lines"]["raised_headroom"] == [
        {"kind": "cuMem out of memory (sleep-mode wake-up)",
         "line": "CUDA Error: out of memory at cumem_allocator.cpp:163"}]


def test_recompute_gives_the_whole_run_pairs_of_the_committed_kv_series():
    """results/one_h100/trl_vllm_colocate_kv merged again from its own records: the
    default pairs over every step are the figures issue 59 recomputed by hand (the
    first generation counted), not the steady state's."""
    import shutil
    import tempfile

    from tests.gpu import vllm_series_merge

    source = os.path.join(ROOT, "results", "one_h100", "trl_vllm_colocate_kv")
    with tempfile.TemporaryDirectory() as scratch:
        for leaf in ("state.json", "logs.tgz"):
            shutil.copy(os.path.join(source, leaf), scratch)
        got = vllm_series_merge.recompute(scratch)
    ratios = [p["ratio"] for p in got["pairs"]["default"]["pairs"]]
    assert [round(r["whole_run_mean_step_s"], 3) for r in ratios] == [1.017, 1.006, 1.177, 1.075]
    assert [round(r["mean_step_s"], 3) for r in ratios] == [1.001, 0.995, 1.199, 1.034]
    # the raised share's pairs say what they are set beside: the default share
    assert {p["against"] for p in got["pairs"]["raised_headroom_2"]["pairs"]} == {
        "the default share (not the best without)"}
    assert json.load(open(os.path.join(source, "whole_run.json")))["pairs"] == got["pairs"]


def test_the_h200_search_record_replays_to_its_shares_and_the_readmes_figures():
    """results/one_h200/trl_vllm_best_without: today's search, replayed from the recorded
    runs, finds the shares the record names and plans the pairs next; the README's
    one-run figures are these runs' own (every step, every generation)."""
    folder = os.path.join(ROOT, "results", "one_h200", "trl_vllm_best_without")
    state = json.load(open(os.path.join(folder, "state.json")))
    runs = state["runs"]
    assert {r["commit"] for r in runs.values()} == {"8ca689742117e2ffe45f80af0cc45cf94f58b3c9"}
    assert {r["machine"]["card"] for r in runs.values()} == {"NVIDIA H200"}
    replay = {"runs": runs}
    args = plan_args(share=0.015292, ballast_gib=59.787, search_step=0.002209,
                     search_high=0.026337, pairs=3)
    todo = drv.plan_runs(replay, args)
    assert replay["shares"]["best"] == 0.01971 and replay["shares"]["raised"] == 0.026337
    assert [r["name"] for r in todo][:2] == ["raised-amem-0", "best-base-0"]
    best, raised = runs["search-base-0.01971"], runs["search-amem-0.026337"]
    assert not runs["search-base-0.021919"]["ok"] and runs["search-base-0.021919"]["failed"]["oom"]
    ratio = lambda key: raised[key] / best[key]  # noqa: E731
    assert round(ratio("whole_run_mean_step_s"), 3) == 0.951
    assert round(ratio("whole_run_tokens_per_s"), 2) == 1.23
    assert round(ratio("kv_cache_tokens"), 2) == 1.58


def test_search_runs_take_search_steps_and_the_pairs_take_steps(tmp_path):
    """A search run only says whether a share fits; the pairs' runs are the figures."""
    args = argparse.Namespace(
        steps=48, steps_per_generation=16, search_steps=32, batch=4, num_generations=8,
        completion_length=1024, max_model_len=2048, prompt_words=16, hidden=64, layers=2,
        heads=4, kv_heads=2, gradient_checkpointing=False, git_head=None)
    search = {"name": "search-base-0.0348", "variant": "search_base"}
    pair = {"name": "best-base-0", "variant": drv.BEST_WITHOUT}
    flags = lambda spec: drv.driver_flags(args, drv.run_steps(spec, args))  # noqa: E731
    assert flags(search)[:2] == ["--steps", "32"] and flags(pair)[:2] == ["--steps", "48"]
    args.search_steps = None
    assert flags(search)[:2] == ["--steps", "48"]


def test_search_steps_under_two_generations_are_refused_at_start_up(capsys):
    with pytest.raises(SystemExit):
        drv.main(["pairs", "--state", "/nonexistent", "--steps-per-generation", "16",
                  "--search-steps", "16"])
    err = capsys.readouterr().err
    assert "under two generations" in err and "--search-steps 32" in err
