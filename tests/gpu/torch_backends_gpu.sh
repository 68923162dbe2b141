#!/usr/bin/env bash
# Every NCCL backend a torch offers, on this GPU: the doctor, the core suite (freed
# bytes, exact results, guard resumes, the caller's thread during an overlapped
# transition), the 1-rank probe and the quick bench, once per backend.
#
#   bash tests/gpu/torch_backends_gpu.sh OUT [RANKS]
#
# Run it in the environment of the torch under test (torch 2.15 on the GPU image:
# eval "$(python3 tests/gpu/vllm_bundle.py env --site /tmp/site-torch2150)", after
# tests/gpu/bundle_torch.sh's parts). torch 2.15's three names:
#   nccl         ProcessGroupNCCL2 (2.15's default)
#   nccl-lazy    ProcessGroupNCCLLazy (AMEM_GPU_PG_BACKEND / --torch-backend)
#   nccl-legacy  ProcessGroupNCCL, as users get it: TORCH_DIST_USE_NCCL2=0 with "nccl"
# A torch without the lazy name (< 2.15) runs the first and the last only.
# Out: OUT/<backend>/{summary.json (run_all: commit, torch, NCCL, env, verdicts),
# core.rank*.json, probe.json, bench/bench.json, bench.log} and OUT/backends.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: torch_backends_gpu.sh OUT [RANKS]}
RANKS=${2:-2}
mkdir -p "$OUT"
has_lazy=$(python3 -c "import torch.distributed as d; print(int(d.is_backend_available('nccl-lazy')))")
backends="nccl nccl-lazy nccl-legacy"
[[ "$has_lazy" == 1 ]] || backends="nccl nccl-legacy"
for b in $backends; do
    dir=$OUT/$b
    mkdir -p "$dir"
    case $b in
        nccl) env_b=(env -u TORCH_DIST_USE_NCCL2 -u AMEM_GPU_PG_BACKEND); name=nccl ;;
        nccl-lazy) env_b=(env -u TORCH_DIST_USE_NCCL2 AMEM_GPU_PG_BACKEND=nccl-lazy); name=nccl-lazy ;;
        nccl-legacy) env_b=(env -u AMEM_GPU_PG_BACKEND TORCH_DIST_USE_NCCL2=0); name=nccl ;;
    esac
    echo "== $b: run_all doctor,core"
    "${env_b[@]}" timeout 300 python3 -m tests.gpu.run_all --out "$dir" --ranks "$RANKS" \
        --small-buffers --only doctor,core --cycles 3 --timeout 150 > "$dir/run_all.log" 2>&1
    echo "   rc $?"
    echo "== $b: probe $name"
    "${env_b[@]}" timeout 180 python3 -m amem_callbacks.tools.probe "$name" > "$dir/probe.json" 2> "$dir/probe.err"
    echo "   rc $? $(tail -c 400 "$dir/probe.json")"
    echo "== $b: bench --torch-backend $name"
    "${env_b[@]}" timeout 240 python3 -m amem_callbacks.tools.cli bench --ranks "$RANKS" \
        --torch-backend "$name" --out "$dir/bench" > "$dir/bench.log" 2>&1
    echo "   rc $?"; grep -E "^P[0-9]|^ *(none|naive|overlap) " "$dir/bench.log" || tail -5 "$dir/bench.log"
    if [[ $b == nccl && -z "${SKIP_FULL:-}" ]]; then
        # NCCL's default buffers: transitions long enough for the caller-thread figure
        # (P5) to count many slices (BACKUP_CYCLES=N adds P6, the backup kept vs re-pinned)
        echo "== $b: bench at NCCL's default buffers"
        "${env_b[@]}" timeout 420 python3 -m amem_callbacks.tools.cli bench --ranks "$RANKS" \
            --full --groups 4 --steps 2 --modes none,naive,overlap --sweep "" --pairs 0 \
            --guard-calls 1200 --backup-cycles "${BACKUP_CYCLES:-0}" --out "$dir/bench_full" \
            > "$dir/bench_full.log" 2>&1
        echo "   rc $?"; grep -E "^P[0-9]" "$dir/bench_full.log" || tail -5 "$dir/bench_full.log"
    fi
done
python3 tests/gpu/torch_backends_summary.py "$OUT" | tee "$OUT/backends.txt"
