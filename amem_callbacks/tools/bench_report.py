"""Turns the bench's raw measurements into ratios, a table, JSON and a plot."""

from __future__ import annotations

import json
import os
import statistics
import sys

from .pairs import Interleaved

GOALS = {"P1": (">=", 0.99), "P2": ("<=", 0.10), "P2b": ("<=", 1.0), "P3": ("<=", 1.01),
         "P4": (">=", 0.99), "P5": (">=", 0.8), "P6": ("<=", 0.15), "P6_over_copy": ("<=", 3.0)}
MEANING = {
    "P1": "device bytes freed / NCCL suspendable bytes",
    "P2": "extra step time, overlap / naive",
    "P2b": "begin -> memory free, overlap / naive",
    "P1_overlap": "P1 for the overlapped begins (worker threads)",
    "P3": "small-collective loop, guard on / off, same state",
    "P3_state": "that loop, others suspended (no guard) / none suspended",
    "P4": "all-reduce bus bandwidth, after / before",
    "recreate_over_overlap": "extra step time, destroy+recreate / overlap",
    "P5": "caller-thread progress during an overlapped begin, vs before",
    "P5_end": "the same during an overlapped end",
    "learn_over_nolearn": "steady step time, rollout touching a group: learn_keep on / off",
    "step_ratio_pairs": "step time, overlap / none, median of interleaved pairs",
    "P6": "warm suspend+resume, s per GiB a rank, NCCL's host backup kept",
    "P6_off": "the same, the backup re-pinned every cycle (NCCL as is)",
    "P6_over_copy": "that cycle (kept) / copying the same bytes out and back",
    "P6_gain": "cycle time, re-pinned / kept",
}
#: What a dry run (noop, CPU) does not measure, and why. Ratios of differences
#: near zero swing wildly: three identical CPU runs gave P2 = -26.7, -1.4, 0.08.
#: Left: P3 (the guard's own per-call cost, the same code as on GPUs) and the
#: pairs' step-time ratio (whole step times, stable).
NOT_MEASURED_DRY = {
    "P1": "nothing is freed in a dry run",
    "P1_overlap": "nothing is freed in a dry run",
    "P2": "noop transitions add no step time: the ratio would divide noise by noise",
    "P2b": "no memory is freed, so there is no time until it is free",
    "P3_state": "nothing is suspended, so both sides run in the same state",
    "P4": "no communicator was suspended, so the bandwidth cannot have changed",
    "recreate_over_overlap": "overlap's extra step time is noise in a dry run",
    "P5": "a noop transition makes no NCCL call that could hold the GIL",
    "P5_end": "a noop transition makes no NCCL call that could hold the GIL",
    "learn_over_nolearn": "a guard resume costs nothing in a dry run",
    "P6": "no NCCL backup in a dry run",
    "P6_off": "no NCCL backup in a dry run",
    "P6_over_copy": "no NCCL backup in a dry run",
    "P6_gain": "no NCCL backup in a dry run",
}


def _mean_steady(values: list) -> float:
    """Mean without the first (warm-up) step when there are more."""
    return statistics.mean(values[1:] if len(values) > 1 else values)


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def _pair_ratios(raw_pairs) -> dict:
    """Step time with / without inside each pair, their median and spread; {} without pairs."""
    if not raw_pairs or not raw_pairs.get("pairs"):
        return {}
    result = Interleaved.from_dict(raw_pairs)
    control = result.control
    drift = None
    if control:  # the control's step time against the pairs' baselines (median)
        drift = control["result"]["step_s"] / statistics.median(result.values("none", "step_s"))
    return {"median": result.ratio("step_s"), "spread": result.spread("step_s"),
            "ratios": result.ratios("step_s"), "pairs": raw_pairs["pairs"],
            "control": control, "control_over_baseline": drift}


def _backup_figures(stage) -> dict:
    """P6 from the host-backup stage (None where it did not run or was skipped)."""
    summary = (stage or {}).get("summary") or {}
    if not summary:
        return {"P6": None, "P6_off": None, "P6_over_copy": None, "P6_gain": None}
    return {"P6": summary["on"]["cycle_s_per_gib"], "P6_off": summary["off"]["cycle_s_per_gib"],
            "P6_over_copy": summary["on_over_copy"], "P6_gain": summary["off_over_on"]}


def _torch_version():
    import torch  # already imported: the ranks ran on it

    return torch.__version__


def summarise(raw: dict, args, world: int, dry_run: bool) -> dict:
    modes = raw["modes"]
    pairs = _pair_ratios(raw.get("pairs"))
    mean = {m: _mean_steady(v["step_s"]) for m, v in modes.items()}
    extra = {m: mean[m] - mean["none"] for m in mean} if "none" in mean else {}
    begins = {m: modes[m]["reports"].get("begin", []) for m in ("naive", "overlap") if m in modes}
    freed = {m: [r["device_freed"] / r["nccl_bytes"] for r in rs
                 if r["device_freed"] is not None and r["nccl_bytes"]] for m, rs in begins.items()}
    if "gpu_freed" in modes.get("naive", {}):  # a shared GPU: all its ranks' bytes
        naive = modes["naive"]
        freed["naive"] = [f / n for f, n in zip(naive["gpu_freed"], naive["nccl_bytes_all_ranks"])
                          if n]
        freed.pop("overlap", None)  # an overlapped begin has no clean reading on a shared GPU
    progress = raw.get("caller_progress", {})
    free_after = {m: _mean_steady([r["wall_s"] for r in rs]) for m, rs in begins.items() if rs}
    guard = raw.get("guard")
    figures = {
        "P1": statistics.mean(freed["naive"]) if freed.get("naive") else None,
        "P1_overlap": statistics.mean(freed["overlap"]) if freed.get("overlap") else None,
        "P2": _ratio(extra.get("overlap"), extra.get("naive")),
        "P2b": _ratio(free_after.get("overlap"), free_after.get("naive")),
        "P3": guard["ratio_median"] if guard else None,
        "P3_state": _ratio(guard["without_s"], guard.get("nothing_suspended_s")) if guard else None,
        "P4": _ratio(raw["bandwidth_after_GBps"], raw["bandwidth_before_GBps"]),
        "recreate_over_overlap": _ratio(extra.get("recreate"), extra.get("overlap")),
        "P5": progress.get("begin", {}).get("ratio"),
        "P5_end": progress.get("end", {}).get("ratio"),
        "learn_over_nolearn": _ratio(mean.get("touch"), mean.get("touch-nolearn")),
        "step_ratio_pairs": pairs.get("median"),
        **_backup_figures(raw.get("host_backup")),
    }
    not_measured = dict(NOT_MEASURED_DRY) if dry_run else {}
    for name in not_measured:  # never a figure computed from noise
        figures[name] = None
    verdicts = {}
    for name, (op, goal) in GOALS.items():
        value = figures[name]
        verdicts[name] = None if value is None else (value >= goal if op == ">=" else value <= goal)
    # A dry run measures the CPU stand-in: goals beside it would say nothing about GPUs.
    goals = {} if dry_run else {k: f"{op} {g}" for k, (op, g) in GOALS.items()}
    return {
        "command": "amem-callbacks bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 else "",
        "dry_run": dry_run, "world": world, "backend": raw["backend"],
        "torch_backend": raw.get("torch_backend"), "torch_backend_class": raw.get(
            "torch_backend_class"), "torch": _torch_version(),
        "commit": raw.get("commit"), "machine": raw.get("machine"),
        "config": {"full": bool(getattr(args, "full", False)), "groups": args.groups,
                   "steps": args.steps, "rollout_s": args.rollout_s, "train_s": args.train_s,
                   "grad_mib": args.grad_mib, "guard_calls": args.guard_calls,
                   "nccl_buffsize": os.environ.get("NCCL_BUFFSIZE"),
                   "overlap_workers": raw["overlap_workers"], "modes": list(modes),
                   "pairs": getattr(args, "pairs", 0)},
        "mean_step_s": mean, "extra_step_s": extra, "mean_parts_s": {
            m: {part: _mean_steady([p[part] for p in v["parts_s"]]) for part in v["parts_s"][0]}
            for m, v in modes.items() if v.get("parts_s")}, "begin_to_memory_free_s": free_after,
        "figures": figures, "not_measured": not_measured,
        "goals": goals, "goal_met": {} if dry_run else verdicts,
        "sweep": raw.get("sweep"), "guard": guard,
        "bandwidth_GBps": [raw["bandwidth_before_GBps"], raw["bandwidth_after_GBps"]],
        "reports": {m: v["reports"] for m, v in modes.items()},
        "caller_progress": progress, "ranks_per_gpu": raw.get("ranks_per_gpu"),
        "touch": {m: {"auto_resumes": modes[m].get("auto_resumes"),
                      "learned": modes[m].get("learned"), "step_s": modes[m]["step_s"]}
                  for m in ("touch", "touch-nolearn") if m in modes},
        "pairs": pairs, "host_backup": raw.get("host_backup"),
        "note": "recreate destroys every group but the default one (torch cannot re-create it)",
    }


def table(summary: dict) -> str:
    lines = ["DRY RUN step times (CPU stand-in, noop backend)"] if summary["dry_run"] else []
    lines.append(f"{'mode':<14}{'mean step s':>12}{'extra s':>10}")
    for mode, value in summary["mean_step_s"].items():
        lines.append(f"{mode:<14}{value:>12.3f}{summary['extra_step_s'].get(mode, 0):>10.3f}")
    if summary.get("sweep"):
        lines += ["", f"{'workers':<10}{'begin s':>10}{'end s':>10}"]
        for workers, row in summary["sweep"].items():
            lines.append(f"{workers:<10}{row['begin_s']:>10.3f}{row['end_s']:>10.3f}")
    pairs = summary.get("pairs")
    if pairs and pairs.get("median") is not None:
        lines += ["", f"interleaved pairs, step time overlap / none: median {pairs['median']:.3f} "
                      f"(spread {pairs['spread'][0]:.3f}-{pairs['spread'][1]:.3f}, "
                      f"{len(pairs['ratios'])} pairs, alternating which side ran first)"]
        if pairs.get("control_over_baseline") is not None:
            lines.append(f"control (none, after the pairs) / the pairs' none: "
                         f"{pairs['control_over_baseline']:.3f}")
    if summary["dry_run"]:
        # CPU stand-in timings: goals beside them would read as verdicts on GPU behaviour
        lines += ["", "DRY RUN figures (nothing is suspended or freed; ratios of the stand-in's "
                      "timings, not GPU results, so no goals)",
                  f"{'figure':<24}{'value':>14}  meaning"]
        not_measured = summary.get("not_measured", {})
        for name, value in summary["figures"].items():
            if name in not_measured:
                lines.append(f"{name:<24}{'not measured':>14}  {not_measured[name]}")
                continue
            shown = "n/a" if value is None else f"{value:.3f}"
            lines.append(f"{name:<24}{shown:>14}  {MEANING[name]}")
        lines += ["", "run on a GPU for real figures, graded against their goals"]
        return "\n".join(lines)
    lines += ["", f"{'figure':<24}{'value':>8}  {'goal':<8} meaning"]
    for name, value in summary["figures"].items():
        shown = "n/a" if value is None else f"{value:.3f}"
        goal = summary["goals"].get(name, "")
        met = summary["goal_met"].get(name)
        mark = "" if met is None else (" ok" if met else " MISSED")
        lines.append(f"{name:<24}{shown:>8}  {goal:<8} {MEANING[name]}{mark}")
    if summary["goal_met"].get("P5") is False:
        lines += suspect_lines(summary.get("caller_progress") or {})
    if not summary["config"].get("full"):
        lines += ["", "quick run: few steps and short transitions, so the timing ratios (P2, "
                      "P2b, P3, P5) are noisier than with --full"]
    if (summary.get("ranks_per_gpu") or 1) > 1:
        lines += ["", f"{summary['ranks_per_gpu']} ranks share each GPU: memory and time are "
                      "shared-GPU figures (P1 counts every sharing rank's NCCL bytes)"]
    return "\n".join(lines)


def suspect_lines(progress: dict) -> list:
    """Under a missed P5: the long C calls of a profiled cycle (tools/progress.py)."""
    lines = ["", "P5 missed; C calls of 2 ms or more in a profiled cycle (a pybind method "
                 "holds the GIL unless torch releases it):"]
    for kind, found in (progress.get("suspects") or {}).items():
        calls = found.get("calls") or []
        shown = ", ".join(f"{name} {took * 1000:.0f} ms ({thread})" for took, name, thread in calls)
        lines.append(f"  {kind}: {shown or 'none'}")
    return lines


def write_outputs(summary: dict, raw: dict, out_dir: str) -> None:
    """Print the results first: a file that cannot be written must not lose them.
    The memory plot is tried before the JSON, which says whether it exists."""
    print(table(summary), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    plot_path = os.path.join(out_dir, "bench_memory.png")
    why_not = plot(raw.get("timeline") or [], plot_path)
    path = os.path.join(out_dir, "bench.json")
    with open(path, "w") as f:
        json.dump(dict(summary, timeline=raw.get("timeline", []),
                       plot={"path": None if why_not else plot_path, "why_not": why_not}),
                  f, indent=1)
    print(f"\nwrote {path}")
    print(f"no memory plot: {why_not}" if why_not else f"wrote {plot_path}")


def plot(timeline: list, path: str):
    """Draw the device-memory timeline into ``path``; None when written, else
    why not, in a few words (the bench prints it and puts it in the JSON)."""
    if not timeline:
        return "a dry run samples no device memory (no GPU)"
    try:  # optional: matplotlib (both; pyplot only after the Agg backend is chosen)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: the plot only
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    t = [row[0] for row in timeline]
    free = [row[1] / 2**30 for row in timeline]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.plot(t, free, lw=1, color="black")
    colours = {"rollout": "#9ecae1", "train": "#fdd0a2"}
    start = 0
    for i in range(1, len(timeline) + 1):
        if i == len(timeline) or timeline[i][2] != timeline[start][2]:
            label = timeline[start][2]
            kind = label.split(":")[-1]
            if kind in colours:
                ax.axvspan(t[start], t[i - 1], color=colours[kind], alpha=0.5, lw=0)
                if kind == "rollout" and (start == 0 or timeline[start - 1][2].split(":")[0]
                                          != label.split(":")[0]):
                    ax.text(t[start], max(free), label.split(":")[0], fontsize=8, va="top")
            start = i
    ax.set_xlabel("seconds")
    ax.set_ylabel("device free memory, GiB (rank 0)")
    ax.set_title("amem-callbacks bench: rollout (blue) and training (orange) per mode")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:  # the JSON still goes out, saying why
        return f"cannot write {path}: {exc.strerror or exc}"
    finally:
        plt.close(fig)
    return None
