#!/usr/bin/env bash
# verl adapter on real NCCL, three runs of tests/gpu/verl_gpu.py and one verdict:
#   1. baseline  (no amem block)
#   2. amem      (actor_rollout_ref.rollout.custom.amem = {enable: true, backend: nccl}),
#                compared with 1: memory at the KV cache, log-probs, losses, step time
#   3. control   (no amem block again), compared with 1: does the baseline repeat
#                itself exactly? (if not, the summary judges 2 by 3's spread)
#
#     tests/gpu/verl_gpu.sh OUTDIR [more verl_gpu.py arguments, for every run]
#
# Needs verl's wheels on PYTHONPATH (tests/gpu/bundle_verl.sh), tests/standins
# (the Ray stand-in), and for 2 ranks on one GPU NCCL >= 2.30 preloaded with
# NCCL_MULTI_RANK_GPU_ENABLE=1. Each run is killed after VERL_GPU_RUN_LIMIT_S
# (default 110 s; the script's own watchdog dumps stacks 15 s earlier).
# CPU check of the plumbing (not a GPU proof):
#     VERL_GPU_AMEM=noop tests/gpu/verl_gpu.sh /tmp/verl-smoke --cpu-smoke
# OUTDIR gets summary.json, baseline.json, amem.json, control.json and
# logs.tar.gz (the three logs and the exit codes): five files.
set -uo pipefail
COMMAND=$(printf '%q ' "$0" "$@")  # as typed: the summary records it (AMEM_RUN_COMMAND)
cd "$(dirname "$0")/../.."
OUT=${1:?usage: tests/gpu/verl_gpu.sh OUTDIR [verl_gpu.py arguments]}
shift
mkdir -p "$OUT"
LIMIT=${VERL_GPU_RUN_LIMIT_S:-110}
NPROC=${VERL_GPU_NPROC:-2}
BACKEND=${VERL_GPU_AMEM:-nccl}  # noop for a CPU check of this wrapper (with --cpu-smoke)
: > "$OUT/exits.txt"

run() {  # name, then verl_gpu.py arguments
    local name=$1 started=$SECONDS rc
    shift
    timeout -k 10 "$LIMIT" python3 -m torch.distributed.run --nproc-per-node "$NPROC" \
        tests/gpu/verl_gpu.py "$OUT/$name.json" --timeout-s $((LIMIT - 15)) "$@" \
        > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: $((SECONDS - started)) s, exit $rc" >> "$OUT/exits.txt"
    echo "$name: $((SECONDS - started)) s, exit $rc;" \
        "$(grep -E '^\[verl_gpu\] amem=' "$OUT/$name.log" | tail -1)"
}

run baseline --amem off "$@"
run amem --amem "$BACKEND" --baseline "$OUT/baseline.json" "$@"
run control --amem off --baseline "$OUT/baseline.json" "$@"
AMEM_RUN_COMMAND="${COMMAND% }" python3 tests/gpu/verl_gpu.py summary "$OUT/summary.json" \
    "$OUT/baseline.json" "$OUT/amem.json" "$OUT/control.json"
rc=$?
tar czf "$OUT/logs.tar.gz" -C "$OUT" baseline.log amem.log control.log exits.txt \
    && rm -f "$OUT"/baseline.log "$OUT"/amem.log "$OUT"/control.log "$OUT"/exits.txt
exit $rc
