#!/usr/bin/env bash
# Megatron-LM's RL loop on the GPU machine: baseline, with amem, baseline again
# (the control says whether the loop is deterministic run to run), then the comparison.
#
#   bash tests/gpu/bundle_megatron.sh          # here, once: fills .gpu/megatron
#   # there (carry .gpu/megatron and an NCCL >= 2.30; LD_PRELOAD set to it):
#   bash tests/gpu/megatron_rl_gpu.sh OUTDIR [RANKS] [extra train_rl.py flags...]
#
# Several ranks on one GPU need NCCL_MULTI_RANK_GPU_ENABLE=1 (set here).
# RUNS picks runs (default "baseline amem control"; NO_CONTROL=1 drops the control,
# SKIP_BASELINE=1 the baseline); the merge runs when OUT has a baseline and an amem run,
# so a run made in a later call can join earlier ones copied into OUT.
set -uo pipefail
OUT=${1:?OUTDIR}; RANKS=${2:-2}; shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
SITE=/tmp/site-megatron
# The wheels into $SITE and the dataset Makefile: the same set-up as the Python drivers.
python3 -c "import sys; sys.path.insert(0, '.'); from experiments import gpu_runs as r; r.install_bundle()" \
    || exit 1
export MAKEFLAGS="LIBEXT=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} NCCL_MULTI_RANK_GPU_ENABLE=1 \
    PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
MLM=.gpu/megatron/mlm
WRAPPER=tests/gpu/megatron_rl_gpu.py

run() {  # NAME ARGS...: one torchrun, bounded; whatever rank 0's servers leave is killed
    local name=$1; shift
    local start=$SECONDS
    setsid timeout -k 10 "${RUN_TIMEOUT:-200}" python3 -m torch.distributed.run \
        --nproc-per-node "$RANKS" --master-port 29533 "$@" >"$OUT/$name.log" 2>&1 &
    local pid=$!
    wait $pid; local rc=$?
    kill -9 -- -$pid 2>/dev/null; pkill -9 -f spawn_main 2>/dev/null; sleep 2
    echo "$name: rc=$rc in $((SECONDS - start)) s"
}

default="baseline amem control"
[ -z "${NO_CONTROL:-}" ] || default=${default% control}
[ -z "${SKIP_BASELINE:-}" ] || default=${default#baseline }
for name in ${RUNS:-$default}; do
    case $name in
    baseline|control) run $name $WRAPPER --probe-out "$OUT/$name" --mlm $MLM "$@" ;;
    amem) run amem -m amem_callbacks.adapters.megatron $WRAPPER --probe-out "$OUT/amem" \
              --mlm $MLM --rl-amem-offload-during-rollout --rl-amem-backend nccl "$@" ;;
    *) echo "RUNS: unknown run '$name' (write baseline, amem or control)"; exit 2 ;;
    esac
done
CONTROL=""; [ ! -e "$OUT/control.rank0.json" ] || CONTROL=$OUT/control
if [ -e "$OUT/baseline.rank0.json" ] && [ -e "$OUT/amem.rank0.json" ]; then
    python3 $WRAPPER --merge "$OUT/baseline" "$OUT/amem" "$CONTROL" --summary "$OUT/summary.json"
fi
