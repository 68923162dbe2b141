"""The soak's series as one PNG: device free memory, host RSS, pinned bytes and
threads per sample, and the cycle time, with the warm-up shaded.

    python tests/gpu/plot_soak.py results/one_h200/soak_real_nccl/soak.json [OUT.png]

A separate step because the GPU image may lack matplotlib: the soak then
writes its JSON with a note, and this draws the PNG wherever matplotlib is.
"""

from __future__ import annotations

import json
import math
import os
import sys

MiB = 2**20
# panel title -> [(series name, unit divisor)]
PANELS = {
    "device free (MiB; the whole GPU's when shared)": [("device_free_after_end", MiB),
                                                       ("device_free_during", MiB)],
    "host RSS (MiB)": [("host_rss_after_end", MiB), ("host_rss_during", MiB)],
    "pinned host memory (MiB)": [("pinned_nccl_suspended_bytes_during", MiB),
                                 ("vmlck_during", MiB), ("vmpin_during", MiB)],
    "threads": [("threads_os_after_end", 1), ("threads_python_after_end", 1)],
}


def plot(result: dict, png: str) -> str:
    """Draw ``result`` (the soak JSON) to ``png``; returns the path or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("not drawn: matplotlib is not installed here; run python tests/gpu/plot_soak.py "
                "on this JSON where it is (pip install matplotlib)")
    series = result["series"]
    fig, axes = plt.subplots(len(PANELS) + 1, 1, figsize=(10, 3 * (len(PANELS) + 1)))
    for ax, (title, lines) in zip(axes, PANELS.items()):
        for name, unit in lines:
            for rank, values in sorted(series.get(name, {}).items(), key=lambda kv: int(kv[0])):
                cycles = series["cycle"][rank]
                points = [(c, v / unit) for c, v in zip(cycles, values) if v is not None]
                if points:
                    ax.plot(*zip(*points), marker=".", linewidth=1, label=f"{name} r{rank}")
        cycles = next(iter(series["cycle"].values()), [])
        if not ax.lines:
            ax.text(0.5, 0.5, "not measured here", ha="center", transform=ax.transAxes)
        elif cycles:  # shade the warm-up the verdict leaves out
            warm = max(1, math.ceil(len(cycles) * 0.1))
            ax.axvspan(cycles[0], cycles[min(warm, len(cycles) - 1)], color="0.9")
        ax.set_title(title, fontsize=9)
        if ax.lines:
            ax.legend(fontsize=6, ncol=4)
    per_cycle = result.get("cycle_seconds_rank0") or []
    if per_cycle:
        axes[-1].plot(range(1, len(per_cycle) + 1), per_cycle, linewidth=0.6)
    axes[-1].set_title("cycle time on rank 0 (s)", fontsize=9)
    axes[-1].set_xlabel("cycle")
    verdict = "PASS" if result.get("ok") else "FAIL"
    versions = result.get("versions") or {}
    fig.suptitle(f"soak {result.get('mode')}: {verdict}, {result.get('cycles')} cycles, "
                 f"{result.get('ranks')} ranks, torch {versions.get('torch')}, "
                 f"NCCL {versions.get('nccl_loaded')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


if __name__ == "__main__":
    path = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.splitext(path)[0] + ".png"
    print(plot(json.load(open(path)), out))
