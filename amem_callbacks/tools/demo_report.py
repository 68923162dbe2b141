"""What ``amem-callbacks demo`` shows at the end: a per-step table, a short
summary in words, and the full metrics as JSON in a file.

Each row is ``(step, loss, begin report, end report, NCCL bytes per rank, GPU
bytes freed or None)``. Counters are read with ``.get``: their names differ
between a dry run and a real one. What is shown of the policy is its public
surface: ``metrics()`` (``amem/inert``, the dry run's ``would_suspend`` figures)
and the rows' reports (the backend's name, and why nothing was done).
"""

from __future__ import annotations

import json
import os
import statistics

MiB = 2**20
_MOVED = ("suspended", "would suspend")


def inert(policy) -> bool:
    """The ranks agreed nothing can be freed here: training ran unchanged."""
    return bool(policy.metrics(last=False).get("amem/inert"))


def dry_run(policy) -> bool:
    """A dry run (noop backend) names what it would suspend in its figures; an
    inert policy finished no begin, so it has none."""
    return "amem/begin/groups_would_suspend" in policy.metrics() and not inert(policy)


def backend_name(rows: list) -> str:
    """The backend the begins went through, as their reports name it."""
    return rows[-1][2].backend if rows else "none"


def print_table(rows: list, policy) -> None:
    shared = rows[-1][2].device_shared_by if rows else 1
    print(f"\nbackend: {backend_name(rows)}"
          f"{' (inert: training ran unchanged)' if inert(policy) else ''}")
    if inert(policy) and rows:  # on its own line: a reason can run to hundreds of characters
        print(f"  why: {rows[-1][2].skipped}")
    if shared > 1:
        print(f"{shared} ranks share GPU 0: 'GPU freed' is the whole device (all {shared} "
              "ranks' buffers), 'NCCL' is each rank's own, from NCCL's stats")
    print(f"{'step':>4}  {'loss':>8}  {'suspended / would':<24}  {'NCCL MiB rank 0':>15}  "
          f"{'NCCL MiB all':>12}  {'GPU freed MiB':>13}  {'begin s':>7}  {'end s':>6}")
    for step, loss, begin, end, nccl_all, freed in rows:
        gpu_freed = f"{freed / MiB:>13.0f}" if freed is not None else f"{'-':>13}"
        moved = ",".join(_moved(begin)) or ("skipped" if begin.skipped else "-")
        print(f"{step:>4}  {loss:>8.4f}  {moved:<24}  "
              f"{begin.nccl_bytes / MiB:>15.0f}  {sum(nccl_all) / MiB:>12.0f}  {gpu_freed}  "
              f"{begin.wall_seconds:>7.3f}  {end.wall_seconds:>6.3f}")
    kept = {g.name: g.reason for g in rows[-1][2].kept} if rows else {}
    if kept:
        print("kept active: " + "; ".join(f"{k} ({v})" for k, v in kept.items()))


def write_json(out: str, rows: list, policy, world: int) -> str:
    path = os.path.join(out, "demo.json")
    data = {
        "backend": rows[-1][2].backend if rows else None,
        "dry_run": dry_run(policy), "inert": inert(policy), "ranks": world,
        "steps": [{"step": step, "loss": loss, "begin": begin.summary(), "end": end.summary(),
                   "groups": {g.name: str(g.action) for g in begin.groups},
                   "nccl_bytes_per_rank": nccl_all, "gpu_freed_bytes": freed,
                   "begin_wall_s": begin.wall_seconds, "end_wall_s": end.wall_seconds}
                  for step, loss, begin, end, nccl_all, freed in rows],
        "metrics_rank0": policy.metrics(),
    }
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return path


def summary(rows: list, policy, path: str) -> str:
    """A few lines in words: what was (or would be) suspended, bytes, times, the file."""
    if not rows:
        return f"\nno steps ran; metrics: {path}"
    last = rows[-1][2]
    moved = _moved(last)
    kept = [g.name for g in last.kept]
    metrics = policy.metrics()
    lines = [""]
    if inert(policy):
        lines.append(f"summary: nothing was suspended, training ran unchanged "
                     f"({last.skipped})")
    elif dry_run(policy):
        lines.append("summary (DRY RUN, noop backend: nothing was suspended or freed)")
        lines.append(f"  would suspend at each rollout: {', '.join(moved) or 'nothing'}")
    else:
        lines.append("summary")
        lines.append(f"  suspended at each rollout: {', '.join(moved) or 'nothing'}")
    if kept:
        lines.append(f"  kept active: {', '.join(kept)}")
    if dry_run(policy):
        lines.append(f"  NCCL memory: {sum(r[2].nccl_bytes for r in rows) / MiB:.0f} MiB (no NCCL "
                     "communicators in a dry run; on GPUs this line gives the MiB suspended)")
    elif not inert(policy):
        per_rank = statistics.mean(r[2].nccl_bytes for r in rows)
        every = statistics.mean(sum(r[4]) for r in rows)
        line = f"  NCCL memory suspended: {per_rank / MiB:.0f} MiB on rank 0, " \
               f"{every / MiB:.0f} MiB on all ranks (mean per rollout)"
        freed = [r[5] for r in rows if r[5] is not None]
        if freed:
            line += f"; GPU memory freed {statistics.mean(freed) / MiB:.0f} MiB"
        lines.append(line)
    begins = [r[2].wall_seconds for r in rows]
    ends = [r[3].wall_seconds for r in rows]
    lines.append(f"  begin took {statistics.mean(begins):.3f} s (max {max(begins):.3f}), end "
                 f"{statistics.mean(ends):.3f} s (max {max(ends):.3f}), over {len(rows)} "
                 "rollouts")
    failures = metrics.get("amem/total/failures", 0)
    guard = metrics.get("amem/total/auto_resumes", 0)
    if failures or guard:
        lines.append(f"  {failures} failed transitions, {guard} guard resumes")
    lines.append(f"  full metrics: {path}")
    return "\n".join(lines)


def _moved(report) -> list:
    return [g.name for g in report.groups if str(g.action) in _MOVED]
