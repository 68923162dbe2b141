#!/usr/bin/env bash
# Device call C: the matrix cells that ran out of memory beside call A's
# calibration run (persist, instances2), alone, and the whole pytest suite beside them.
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
export LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONUNBUFFERED=1
[ -e amem_callbacks/adapters ] || ln -sfn ../adapters amem_callbacks/adapters
W=/tmp/c; mkdir -p $W
( timeout 285 python3 -m pytest -v -ra -p no:cacheprovider > $W/pytest.log 2>&1; echo "pytest rc=$?" >> $W/pytest.log ) &
timeout 285 python3 tests/gpu/megatron_matrix.py $W/matrix --cells do_ogr_opg_persist,instances2 --waves 1 --timeout 230 > $W/matrix.log 2>&1
echo "matrix rc=$?" >> $W/matrix.log
wait
cp $W/matrix/megatron_configs.json $W/pytest.log $OUT/ 2>/dev/null
tar czf $OUT/c.tgz -C $W . 2>/dev/null
tail -5 $W/matrix.log; grep -cE "PASSED" $W/pytest.log; grep -E "FAILED|ERROR|passed|failed|pytest rc" $W/pytest.log | tail -12
