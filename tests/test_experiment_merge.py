"""The rollout-gain experiment's arithmetic on synthetic run records: ratios per
pair, medians, the control verdict (the GPU run feeds it real records)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_run(folder, name, tokens_per_s, blocks, step_s, rc=0, amem=False):
    prefix = os.path.join(folder, name)
    with open(prefix + ".outcome.json", "w") as f:
        json.dump({"rc": rc, "seconds": 80.0, "command": f"cmd {name}", "tail": ""}, f)
    if rc != 0:
        return
    record = {"rank": 0, "generations": [
        {"generated_tokens": 100, "seconds": 1.0, "evictions": 0},
        {"generated_tokens": 1000, "seconds": 1000 / tokens_per_s, "evictions": 0}],
        "kv_cache_allocations": [{"kv_bytes": 1}, {"kv_bytes": blocks * 10, "blocks": blocks,
                                                   "block_tokens": 32, "max_requests": 96}],
        "iterations": [{"iteration": i, "time": i * step_s, "loss": {"lm loss": 1.0}}
                       for i in range(4)], "amem": None}
    if amem:
        record["amem"] = {"installed": True, "transitions": [
            {"kind": "begin", "wall_seconds": 2.0, "skipped": None, "held_seconds": 0.25},
            {"kind": "end", "wall_seconds": 1.0, "skipped": None}] * 2,
            "caller_waits": {"start": 0.2, "stop": 0.0, "memory": 1.8},
            "metrics": {"amem/total/guard_wait_seconds": 0.4, "amem/total/auto_resumes": 0,
                        "amem/guard_wait/dp/calls": 2, "amem/guard_wait/dp/seconds": 0.4}}
    with open(prefix + ".rank0.json", "w") as f:
        json.dump(record, f)


def test_merge_reports_medians_of_pair_ratios_and_the_control(tmp_path):
    sys.path.insert(0, ROOT)
    from experiments import rollout_gain

    folder = str(tmp_path)
    for index, (tps_with, step_with) in enumerate([(130.0, 9.0), (125.0, 9.5), (140.0, 8.0)]):
        write_run(folder, f"pair{index}_without", 100.0, 100, 10.0)
        write_run(folder, f"pair{index}_with", tps_with, 130, step_with, amem=True)
    write_run(folder, "control", 0, 0, 0, rc=1)
    rollout_gain.main(["merge", folder])
    gain = json.load(open(os.path.join(folder, "rollout_gain.json")))
    assert abs(gain["capacity_ratio"] - 130 / 100 * 1.0) < 0.02  # (blocks - 1) * tokens
    assert gain["rollout_tokens_per_s_ratio"] == 1.3 and gain["rollout_tokens_per_s_ratio_spread"] \
        == [1.25, 1.4]
    assert gain["step_time_ratio"] == 0.9 and gain["control_fails"] is True
    assert len(gain["pairs"]) == 3 and gain["pairs"][1]["order"] == ["with", "without"]
    critical = json.load(open(os.path.join(folder, "critical_path.json")))
    # (0.2 + 1.8 + 0.4) s waited over 2 rollouts, against (2 + 1) s of transitions each
    assert critical["critical_path_s"] == 1.2 and critical["transition_wall_s"] == 3.0
    assert abs(critical["critical_fraction"] - 0.4) < 1e-9
    run = critical["per_run"][0]
    assert run["guard_wait_by_group"] == {"dp": 0.4} and run["begin_held_s"] == [0.25, 0.25]


def test_merge_splits_the_rollout_into_the_wait_for_the_kv_cache_and_generation(tmp_path):
    """The slower rank counts; the first rollout (cache from the launch) does not."""
    sys.path.insert(0, ROOT)
    from experiments import rollout_gain

    folder = str(tmp_path)
    for index in range(2):
        for side, wait, generation in (("without", 0.1, 10.0), ("with", 3.0, 8.0)):
            write_run(folder, f"pair{index}_{side}", 100.0, 100, 10.0, amem=side == "with")
            for rank, lag in ((0, 0.0), (1, 0.5)):  # rank 1 is the slower one
                path = os.path.join(folder, f"pair{index}_{side}.rank{rank}.json")
                record = json.load(open(path)) if rank == 0 else json.load(open(
                    os.path.join(folder, f"pair{index}_{side}.rank0.json")))
                record["rank"] = rank
                record["events"] = [e for t in (0.0, 100.0) for e in (
                    ["rollouts_asked", t], ["kv_allocated", t + wait + lag],
                    ["rollouts_back", t + wait + lag + generation + lag])]
                record["train_step_seconds"] = [5.0 + lag, 6.0 + lag]
                json.dump(record, open(path, "w"))
    rollout_gain.main(["merge", folder])
    gain = json.load(open(os.path.join(folder, "rollout_gain.json")))
    assert gain["wait_before_kv_s"] == pytest.approx({"without": 0.6, "with": 3.5})
    assert abs(gain["generation_s_ratio"] - 8.5 / 10.5) < 1e-9
    assert abs(gain["generation_tokens_per_s_ratio"] - 10.5 / 8.5) < 1e-9
    assert gain["train_step_time_ratio"] == 1.0


def test_the_first_experiments_recorded_runs_merge_to_their_committed_figures(tmp_path):
    """The merge reads the new design's figures (a grown rollout holds two KV
    allocations; engine steps) and must still read the first design's records as it
    did: re-merged, results/one_h200/rollout_gain_megatron_dp2/runs.tgz gives every key
    its committed rollout_gain.json and critical_path.json hold."""
    import tarfile

    sys.path.insert(0, ROOT)
    from experiments import rollout_gain

    results = os.path.join(ROOT, "results", "one_h200", "rollout_gain_megatron_dp2")
    with tarfile.open(os.path.join(results, "runs.tgz")) as tar:
        tar.extractall(tmp_path)
    rollout_gain.main(["merge", str(tmp_path)])
    for name, skip in (("rollout_gain.json", {"pairs", "control", "commands", "goals"}),
                       ("critical_path.json", {"per_run", "commands", "loop"})):
        committed = json.load(open(os.path.join(results, name)))
        merged = json.load(open(tmp_path / name))
        for key in set(committed) - skip:
            assert merged[key] == committed[key], (name, key)
    committed = json.load(open(os.path.join(results, "rollout_gain.json")))
    merged = json.load(open(tmp_path / "rollout_gain.json"))
    for key, verdict in committed["goals"].items():
        assert merged["goals"][key] == verdict
    for old, new in zip(committed["pairs"], merged["pairs"]):
        for side, figures in old["results"].items():
            for key, value in figures.items():
                assert new["results"][side][key] == value, (old["index"], side, key)
    # the first design kept max_requests (180) while the blocks grew; its begin
    # suspended 4.5 GiB a rank, 45 % of the 10 GiB cache
    assert merged["max_requests"] == {"without": 180, "with": 180}
    assert abs(merged["freed_fraction_of_kv"] - 0.45) < 0.01


def test_the_growth_off_pairs_split_each_iteration_into_its_three_parts(tmp_path):
    """Growth changes only the generation; the log-prob step after it and the training
    step are the same work on both sides. The merge says how long each part took (from
    the records' own marks, the slower rank) and pools every measured iteration, so a
    ratio moved by the loop's noise outside the generation shows as such. Re-read here
    from the real GPU records (sessions E and G), independently of the merge's code."""
    import statistics
    import tarfile

    sys.path.insert(0, ROOT)
    from experiments import rollout_gain

    results = os.path.join(ROOT, "results", "one_h200", "rollout_gain_megatron_dp2_growth_off")
    with tarfile.open(os.path.join(results, "runs.tgz")) as tar:
        tar.extractall(tmp_path)
    rollout_gain.main(["merge", str(tmp_path)])
    gain = json.load(open(tmp_path / "rollout_gain.json"))
    pairs = sorted({name.split("_")[0] for name in os.listdir(tmp_path)
                    if name.startswith("pair") and name.endswith(".rank0.json")})
    assert len(pairs) == len(gain["pairs"]) >= 2  # pair 0 (session E) and 1 (session G)
    diffs = {}
    for side in ("nogrow", "with"):
        after, step, diffs[side] = [], [], []
        for pair in pairs:
            ranks = [json.load(open(tmp_path / f"{pair}_{side}.rank{r}.json")) for r in (0, 1)]
            after.append(statistics.median(
                max(rank["rollouts"][k]["seconds"] - rank["generations"][k]["seconds"]
                    for rank in ranks) for k in range(1, 4)))
            times = [it["time"] for it in ranks[0]["iterations"]]
            each = [b - a for a, b in zip(times[1:], times[2:])]
            step.append(statistics.median(each))
            diffs[side] += each
        phases = gain["iteration_phases"][side]  # medians of the pairs' own medians
        assert phases["after_rollout_s"] == pytest.approx(statistics.median(after))
        assert phases["step_s"] == pytest.approx(statistics.median(step))
        assert set(phases) == {"generation_s", "after_rollout_s", "train_step_s", "step_s"}
    pooled = statistics.mean(diffs["with"]) / statistics.mean(diffs["nogrow"])
    assert gain["step_time_ratio_pooled"] == pytest.approx(pooled)
    # what the pairs showed (medians 9.76 against 9.93 s): a slightly shorter generation
    # with growth, the rest noisier
    assert (gain["iteration_phases"]["with"]["generation_s"]
            < gain["iteration_phases"]["nogrow"]["generation_s"])
