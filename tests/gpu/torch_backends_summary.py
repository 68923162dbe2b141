"""One table from tests/gpu/torch_backends_gpu.sh's folders: per torch backend, the class
torch made, the path the package took, what the core suite, the probe and the bench found.

    python3 tests/gpu/torch_backends_summary.py OUT      # writes OUT/backends.json, prints it

A backend passes when the doctor and the core suite passed (run_all's verdicts), the probe
suspended and stayed exact, and the bench ran with every byte freed (P1 >= 0.99) and the
caller's thread running during an overlapped begin (P5 >= 0.8). Each row says which of
those failed, so a failing backend is named with its reason, never hidden in a mean.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from experiments.gpu_runs import load_json as _load  # noqa: E402

P1_GOAL, P5_GOAL = 0.99, 0.8


def _probe(folder: str):
    """The probe's JSON line (its stdout may hold NCCL's own lines before it)."""
    try:
        with open(os.path.join(folder, "probe.json")) as f:
            lines = [line for line in f if line.startswith("{")]
    except OSError:
        return None
    return json.loads(lines[-1]) if lines else None


def _bench_row(bench) -> dict:
    if not bench:
        return {"ran": False}
    figures = bench.get("figures", {})
    begins = [r["wall_s"] for r in bench.get("reports", {}).get("naive", {}).get("begin", [])]
    ends = [r["wall_s"] for r in bench.get("reports", {}).get("naive", {}).get("end", [])]
    return {"ran": True, "class": bench.get("torch_backend_class"), "torch": bench.get("torch"),
            "P1": figures.get("P1"), "P5": figures.get("P5"), "P5_end": figures.get("P5_end"),
            "P6": figures.get("P6"), "P6_off": figures.get("P6_off"),
            "naive_begin_s": begins, "naive_end_s": ends,
            "nccl_buffsize": bench.get("config", {}).get("nccl_buffsize")}


def backend_row(folder: str) -> dict:
    run_all = _load(os.path.join(folder, "summary.json")) or {}
    suites = run_all.get("suites", {})
    cores = [_load(os.path.join(folder, f"core.rank{r}.json")) for r in range(8)]
    cores = [c for c in cores if c]
    probe = _probe(folder)
    bench = _bench_row(_load(os.path.join(folder, "bench", "bench.json")))
    full = _bench_row(_load(os.path.join(folder, "bench_full", "bench.json")))
    failed = [f"{name}: {row.get('skipped') or 'failed'}"
              for name, row in suites.items() if not row.get("ok")]
    if not suites:
        failed.append("run_all: no summary.json")
    failed += sorted({f"core check {k}" for c in cores for k, v in c["checks"].items() if not v})
    if not probe or not probe.get("ok"):
        failed.append(f"probe: {(probe or {}).get('error', 'no result')}")
    for label, row in (("bench", bench), ("bench_full", full)):
        if label == "bench_full" and not row["ran"]:
            continue
        if not row["ran"]:
            failed.append(f"{label}: no bench.json")
            continue
        if (row["P1"] or 0) < P1_GOAL:
            failed.append(f"{label}: P1 {row['P1']} < {P1_GOAL}")
        if (row["P5"] or 0) < P5_GOAL:
            failed.append(f"{label}: P5 {row['P5']} < {P5_GOAL}")
    return {
        "torch": run_all.get("torch") or bench.get("torch"), "commit": run_all.get("commit"),
        "nccl_loaded": run_all.get("nccl_loaded"), "gpus": run_all.get("gpus"),
        "env": run_all.get("env"),
        "probe": {k: (probe or {}).get(k) for k in ("torch_backend", "class", "path", "why",
                                                    "suspended_per_nccl", "suspendable_bytes",
                                                    "device_freed_bytes", "exact_after",
                                                    "host_backup")},
        "core": {"paths": sorted({p for c in cores for p in c["first_begin"]["paths"]}),
                 "freed": [c["first_begin"]["freed"] for c in cores],
                 "freed_expected": [c["first_begin"]["freed_expected"] for c in cores],
                 "caller_progress": [c.get("caller_progress") for c in cores]},
        "bench": bench, "bench_full": full,
        "failed": failed, "ok": not failed,
    }


def summarise(out: str) -> dict:
    rows = {name: backend_row(os.path.join(out, name)) for name in sorted(os.listdir(out))
            if os.path.isdir(os.path.join(out, name))}
    return {"backends": rows, "ok": bool(rows) and all(r["ok"] for r in rows.values())}


def main(argv: list) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    result = summarise(argv[0])
    with open(os.path.join(argv[0], "backends.json"), "w") as f:
        json.dump(result, f, indent=1)
    for name, row in result["backends"].items():
        print(f"{name:12} {'ok' if row['ok'] else 'FAILED'}  torch {row['torch']}  class "
              f"{row['probe']['class']}  path {row['probe']['path']}  bench P1 "
              f"{row['bench'].get('P1')} P5 {row['bench'].get('P5')}"
              + (f"  full P5 {row['bench_full']['P5']} P6 {row['bench_full']['P6']}"
                 if row["bench_full"]["ran"] else ""))
        for why in row["failed"]:
            print(f"    {why}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
