#!/usr/bin/env bash
# The host-backup hook's GPU runs (amem_callbacks/host_backup.py), stage by stage, in one
# device call: NCCL 2.30.7 preloaded (.nccl/ from ../shared/tools/device-nccl, carried),
# two ranks on one GPU. Each stage is bounded; its log and JSON go to OUT, whose archive
# the caller brings back.
#
#   AMEM_COMMIT=<sha, written out: the GPU machine's copy may keep stale git metadata> bash tests/gpu/host_backup_series.sh OUT smoke bench stall reliability
#   AMEM_COMMIT=<sha> bash tests/gpu/host_backup_series.sh OUT soak core
#
# smoke        5 cycles, 1 group: the hook active on real NCCL, every resume exact (a
#              failure stops the series: nothing after it would mean anything)
# bench        amem-callbacks bench at NCCL's default buffers, 4 groups: P6 (re-pinned
#              against kept, blocks alternating, one run) beside P1-P5
# stall        suspend_stall_gpu.py with the backup re-pinned (AMEM_HOST_BACKUP=0), then kept
# reliability  the fault and disagreement cases of reliability_gpu.py, the backup kept
# soak         1,000 cycles at NCCL's default buffers, 1 group, the backup kept
# core         tests/gpu/core_gpu.py, the backup kept
set -uo pipefail
out=$1; shift
mkdir -p "$out" /tmp/nccl
[ -f /tmp/nccl/libnccl.so.2 ] || python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'), open('/tmp/nccl/libnccl.so.2', 'wb'))" || exit 1
export PYTHONPATH=$PWD LD_PRELOAD=/tmp/nccl/libnccl.so.2 NCCL_MULTI_RANK_GPU_ENABLE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/machine.txt" 2>&1
stage() {  # name, bound in seconds, command...
  local name=$1 bound=$2; shift 2
  local start=$SECONDS
  timeout "$bound" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - start)) s" | tee -a "$out/stages.txt"
  return $rc
}
for s in "$@"; do
  case $s in
    smoke) stage smoke 120 python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/host_backup_gpu.py "$out/smoke.json" --cycles 5 \
             && [ -f "$out/smoke.rank1.json" ] || exit 1 ;;
    bench) stage bench 330 python3 -m amem_callbacks bench --full --ranks 2 --groups 4 --steps 2 \
             --modes none,naive,overlap --pairs 0 --sweep "" --guard-calls 240 --backup-cycles 3 \
             --out "$out/bench" ;;
    stall) AMEM_HOST_BACKUP=0 stage stall_repinned 150 python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/suspend_stall_gpu.py "$out/stall_repinned.json" 1
           stage stall_kept 150 python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/suspend_stall_gpu.py "$out/stall_kept.json" 1 ;;
    reliability) stage reliability 300 python3 tests/gpu/reliability_gpu.py "$out/reliability.json" \
                   interleavings disagreement cycles kill_in_suspend kill_in_resume rank_dies ;;
    soak) stage soak 420 python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/host_backup_gpu.py "$out/soak.json" --cycles 1000 --groups 1 ;;
    core) stage core 200 python3 -m torch.distributed.run --nproc-per-node 2 tests/gpu/core_gpu.py "$out/core.json" ;;
    *) echo "unknown stage $s" >&2; exit 2 ;;
  esac
done
