#!/usr/bin/env bash
# Device call B: rollout gain, interleaved pairs then the control (alone on the GPU).
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
export LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONUNBUFFERED=1
[ -e amem_callbacks/adapters ] || ln -sfn ../adapters amem_callbacks/adapters
W=/tmp/b; mkdir -p $W
timeout 440 python3 experiments/rollout_gain.py run $W/gain --pairs 2 --control --iters 2 \
    --buffer-gb 10 --leave-gb 27 --timeout 125 --budget-s 400 --pack-to $OUT > $W/gain.log 2>&1
echo "gain rc=$?" >> $W/gain.log
python3 experiments/rollout_gain.py merge $W/gain >> $W/gain.log 2>&1
cp $W/gain/rollout_gain.json $W/gain/critical_path.json $OUT/ 2>/dev/null
cp $W/gain.log $OUT/
tail -25 $W/gain.log
