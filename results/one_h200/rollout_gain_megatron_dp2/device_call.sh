#!/usr/bin/env bash
# Rollout gain (and the critical path of the with runs): interleaved pairs, alone on the GPU.
# bash .gpu/call_gain.sh FIRST PAIRS [--control]
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
export LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONUNBUFFERED=1
[ -e amem_callbacks/adapters ] || ln -sfn ../adapters amem_callbacks/adapters
W=/tmp/g; mkdir -p $W
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch,sys; print(torch.__version__, sys.version.split()[0])"; } > $OUT/machine.txt 2>&1
timeout 560 python3 experiments/rollout_gain.py run $W/gain --first $1 --pairs $2 ${3:-} --iters 2 \
    --buffer-gb 10 --leave-gb 30 --timeout 150 --budget-s 480 --pack-to $OUT > $W/gain.log 2>&1
echo "gain rc=$?" >> $W/gain.log
cp $W/gain.log $OUT/gain_$1.log
tail -20 $W/gain.log; for f in $W/gain/*.log; do echo "== $f"; grep -iE "error|out of memory|Traceback" $f | head -5; done
