#!/usr/bin/env bash
# Soak on real NCCL (4 ranks on one H200), then the in-call faults, each alone on the GPU.
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
export LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONUNBUFFERED=1
[ -e amem_callbacks/adapters ] || ln -sfn ../adapters amem_callbacks/adapters
timeout 330 env PYTHONPATH=$PWD python3 tests/gpu/soak_gpu.py --out $OUT/soak.json --seconds 270 --ranks 4 > $OUT/soak.log 2>&1
echo "soak rc=$?" >> $OUT/soak.log
AMEM_GPU_QUICK=1 timeout 200 env PYTHONPATH=$PWD python3 tests/gpu/reliability_gpu.py $OUT/faults.json kill_in_suspend kill_in_resume stop_in_begin interleavings > $OUT/faults.log 2>&1
echo "faults rc=$?" >> $OUT/faults.log
tail -15 $OUT/soak.log; tail -15 $OUT/faults.log
