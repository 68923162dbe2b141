#!/usr/bin/env bash
# Device call A: the Megatron configuration matrix (2 waves), the rollout-gain
# calibration run beside wave 1, and the whole pytest suite (niced) beside both.
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
export LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONUNBUFFERED=1
[ -e amem_callbacks/adapters ] || ln -sfn ../adapters amem_callbacks/adapters
W=/tmp/a; mkdir -p $W
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch,sys; print(torch.__version__, sys.version.split()[0])"; } > $W/machine.txt 2>&1
python3 -c "import sys; sys.path.insert(0,'.'); from tests.gpu import megatron_runs as r; r.install_bundle()" > $W/install.log 2>&1
( nice -n 15 timeout 500 python3 -m pytest -q -ra -p no:cacheprovider > $W/pytest.log 2>&1; echo "pytest rc=$?" >> $W/pytest.log ) &
( timeout 330 python3 experiments/rollout_gain.py calibrate $W/gain --timeout 300 > $W/calibrate.log 2>&1 ) &
timeout 520 python3 tests/gpu/megatron_matrix.py $W/matrix --waves 2 --timeout 240 > $W/matrix.log 2>&1
echo "matrix rc=$?" >> $W/matrix.log
wait
cp $W/matrix/megatron_configs.json $W/gain/calibration.json $W/pytest.log $OUT/ 2>/dev/null
tar czf $OUT/a.tgz -C $W . 2>/dev/null
cat $W/machine.txt; tail -3 $W/install.log; cat $W/matrix.log | tail -15; tail -4 $W/calibrate.log; tail -6 $W/pytest.log
