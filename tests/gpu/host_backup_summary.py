"""The host-backup records of one results folder (tests/gpu/host_backup_series.sh's
output, merged by hand into results/), read into summary.json: the figures the README
and docs quote, each computed here from the rank records, none typed in.

    python3 tests/gpu/host_backup_summary.py results/one_h100/host_backup_reuse
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def _load(path: str):
    with open(path) as f:
        return json.load(f)


def bench(path: str) -> dict:
    stage = _load(path)["host_backup"]
    summary = stage["summary"]
    gib = stage["bytes"] / 2**30
    return {"gib_a_rank": gib, "workers": stage["workers"],
            "re_pinned": summary["off"], "kept": summary["on"],
            "re_pinned_over_kept": summary["off_over_on"], "copy_s": summary["copy_s"],
            "kept_over_copy": summary["on_over_copy"], "memset_s": stage["floor"].get("memset_s"),
            "first_cycle": stage["first_cycle"]}


def stall(folder: str, name: str) -> dict:
    """Per rank: the work's extra seconds beside an overlapped begin, the transition, the
    longest step (a step is 5 ms without one)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, f"{name}.rank*.json"))):
        record = _load(path)
        rows = record["rows"]
        base = statistics.median(r["work_s"] for r in rows if r["mode"] == "none")
        over = [r for r in rows if r["mode"] == "overlapped"]
        out[f"rank{record['rank']}"] = {
            "kept": record["host_backup"]["kept"],
            "extra_work_s": statistics.median(r["work_s"] for r in over) - base,
            "transition_s": statistics.median(r["transition_s"] for r in over),
            "longest_step_s": max(r["step_s_max"] for r in over)}
    return out


def soak(folder: str) -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "soak.rank*.json"))):
        record = _load(path)
        cycles, readings = record["cycles"], record["readings"]
        out[f"rank{record['rank']}"] = {
            "ok": record["ok"], "checks": record["checks"], "cycles": len(cycles),
            "commit": record["commit"], "card": record["machine"]["card"],
            "gib_a_rank": cycles[0]["bytes"] / 2**30,
            "first_cycle_s": cycles[0]["suspend_s"] + cycles[0]["resume_s"],
            "suspend_s_median": statistics.median(c["suspend_s"] for c in cycles[1:]),
            "resume_s_median": statistics.median(c["resume_s"] for c in cycles[1:]),
            "rss_gib_first_last": [readings[1]["rss"] / 2**30, readings[-1]["rss"] / 2**30],
            "pinned_new_after_first_cycle": cycles[-1]["pinned_new"] - cycles[0]["pinned_new"]}
    return out


def reliability(folder: str) -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "reliability*.json"))):
        for case in _load(path)["cases"]:
            out[case["case"]] = {"ok": case["ok"], "seconds": case["seconds"]}
    return out


def summarise(folder: str) -> dict:
    core = [_load(p) for p in sorted(glob.glob(os.path.join(folder, "core.rank*.json")))]
    zeroing_kept = glob.glob(os.path.join(folder, "bench_zeroing_kept_*.json"))
    return {
        "bench": bench(os.path.join(folder, "bench", "bench.json")),
        "bench_zeroing_kept": bench(zeroing_kept[0]) if zeroing_kept else None,
        "stall": {"re_pinned": stall(folder, "stall_repinned"),
                  "kept": stall(folder, "stall_kept")},
        "soak": soak(folder),
        "core": {f"rank{c['rank']}": all(c["checks"].values()) for c in core},
        "reliability": reliability(folder),
    }


def main() -> int:
    folder = sys.argv[1]
    summary = summarise(folder)
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["bench"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
