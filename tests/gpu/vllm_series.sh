#!/usr/bin/env bash
# Runs of tests/gpu/trl_vllm_gpu.py by hand, one after another on one GPU (issue 34),
# with the KV-bound workload of results/one_h100/trl_vllm_colocate_kv:
#
#   eval "$(python3 tests/gpu/vllm_bundle.py env)"
#   bash tests/gpu/vllm_series.sh DIR GIT_SHA "NAME FLAGS..." ["NAME FLAGS..." ...]
#
# e.g. "sw-default --share 0.027 --amem --ballast-gib 29.476 --short-wake 2:1".
# Before each run, whatever still holds GPU memory is ended (a failed run's ranks live
# in sessions of their own; never `pkill -f`, which matched its own shell); each run is
# bounded (SERIES_RUN_S, default 240 s). DIR/NAME gets the log, the rank JSONs and
# merged.json (trl_vllm_gpu.py merge), and DIR/series.tgz all of them (no model folders).
#
# SERIES_SCALE_FROM=BYTES (a card of another size than the one the shares were set on,
# e.g. 85017493504, torch's total of one H100 80GB): each --share S becomes
# S x BYTES / this card's total (vLLM's budget, share x total, stays the same bytes)
# and each --ballast-gib B gets (this total - BYTES) / 2 ranks added (the rest of the
# card stays as full), so the runs fill the larger card as they filled the smaller.
set -u
dir=$1 sha=$2
shift 2
python=${PYTHON:-python3}
total=""
if [ -n "${SERIES_SCALE_FROM:-}" ]; then
  total=$("$python" -c "import torch; print(torch.cuda.mem_get_info()[1])" </dev/null)
  echo "scaling the shares and ballasts from a ${SERIES_SCALE_FROM}-byte card to this ${total}-byte one"
fi
# SERIES_WORKLOAD replaces the workload's flags (tests/test_short_wake.py: a tiny one on CPU)
workload="${SERIES_WORKLOAD:---steps 48 --batch 4 --steps-per-generation 16 --num-generations 8
  --completion-length 1024 --max-model-len 2048 --prompt-words 16 --hidden 1024 --layers 24
  --heads 8 --kv-heads 8 --gradient-checkpointing} --git-head $sha"
port=${SERIES_PORT:-29610}  # each run the next one
end_gpu_holders() {  # not in the CPU mode: on a GPU host its caller (pytest) may hold the GPU
  if [ "${AMEM_GPU_DRIVER_ON_CPU:-}" != 1 ]; then
    nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9
  fi
}
for spec in "$@"; do
  read -r name flags <<<"$spec"
  if [ -n "$total" ]; then
    flags=$("$python" tests/gpu/vllm_series_scale.py "$SERIES_SCALE_FROM" "$total" $flags)
  fi
  run="$dir/$name"
  mkdir -p "$run"
  end_gpu_holders
  sleep 3
  began=$(date +%s)
  # shellcheck disable=SC2086 - the flags are words
  timeout -k 10 "${SERIES_RUN_S:-240}" "$python" -m torch.distributed.run --nproc-per-node 2 \
    --master-port "$port" tests/gpu/trl_vllm_gpu.py run "$run/rank" --work "$run/work" \
    $flags $workload </dev/null >"$run/log.txt" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - began ))
  # what tests/gpu/vllm_series_merge.py needs beside the rank JSONs: how the run ended
  printf '%s %s\n' "$rc" "$seconds" >"$run/rc.txt"
  echo "== $name rc=$rc $seconds s: $flags"
  grep -E "^rank [0-9]:" "$run/log.txt" | tail -2
  "$python" tests/gpu/trl_vllm_gpu.py merge "$run/rank" --log "$run/log.txt" >"$run/merged.json" \
    2>"$run/merge-error.txt" </dev/null || echo "   merge failed: $(tail -1 "$run/merge-error.txt")"
  rm -rf "$run/work"
  port=$((port + 1))
done
end_gpu_holders
# written beside DIR, then moved in: an archive growing inside the folder it reads
# changes that folder under tar ("file changed as we read it", exit 1)
tar czf "$dir.series.tgz" -C "$dir" --exclude=series.tgz . && mv "$dir.series.tgz" "$dir/series.tgz"
