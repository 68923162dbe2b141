#!/usr/bin/env bash
# The whole pytest suite on a GPU host (real NCCL preloaded), and beside it the
# random begin/end interleavings the fault call ran out of time for.
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
export LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONUNBUFFERED=1
[ -e amem_callbacks/adapters ] || ln -sfn ../adapters amem_callbacks/adapters
python3 -c "import sys; sys.path.insert(0,'.'); from tests.gpu import megatron_runs as r; r.install_bundle()" > $OUT/install.log 2>&1
( AMEM_GPU_QUICK=1 timeout 300 env PYTHONPATH=$PWD python3 tests/gpu/reliability_gpu.py $OUT/interleavings.json interleavings > $OUT/interleavings.log 2>&1; echo "interleavings rc=$?" >> $OUT/interleavings.log ) &
timeout 500 python3 -m pytest -v -ra -p no:cacheprovider --durations=15 > $OUT/pytest.log 2>&1
echo "pytest rc=$?" >> $OUT/pytest.log
wait
tail -4 $OUT/interleavings.log; grep -cE "PASSED" $OUT/pytest.log; grep -E "FAILED|ERROR|passed|failed|pytest rc" $OUT/pytest.log | tail -12
