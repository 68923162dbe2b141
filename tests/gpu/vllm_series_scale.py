"""vllm_series.sh's SERIES_SCALE_FROM: a run's flags set on one card, for another.

    python3 tests/gpu/vllm_series_scale.py FROM_BYTES TO_BYTES FLAGS... -> the flags

``--share S`` -> S x FROM / TO (vLLM's budget is share x the card's total: the same
bytes), ``--ballast-gib B`` -> B + (TO - FROM) / RANKS GiB (the rest of the larger card
held as the smaller one's was), two ranks on the card as the series runs them.
"""

from __future__ import annotations

import sys

GIB = 2**30
RANKS = 2


def scaled(flags: list, from_bytes: int, to_bytes: int, ranks: int = RANKS) -> list:
    out = list(flags)
    for i, flag in enumerate(out[:-1]):
        if flag == "--share":
            out[i + 1] = f"{float(out[i + 1]) * from_bytes / to_bytes:.6f}"
        elif flag == "--ballast-gib":
            out[i + 1] = f"{float(out[i + 1]) + (to_bytes - from_bytes) / ranks / GIB:.3f}"
    return out


if __name__ == "__main__":
    print(" ".join(scaled(sys.argv[3:], int(sys.argv[1]), int(sys.argv[2]))))
