set -u
bash experiments/campaign.sh setup > $OUT/setup.log 2>&1 || { tail $OUT/setup.log; exit 1; }
export LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONUNBUFFERED=1
( while sleep 15; do cp /tmp/g/pack/pack2176.log $OUT/ 2>/dev/null; done ) &
python3 .stage/probe_pack.py /tmp/g/pack 2176 ${1:-420}
cp /tmp/g/pack/* $OUT/ 2>/dev/null; ls $OUT
grep -E "iteration +1/|Sequence Packing\]|elapsed time|Error|error:" /tmp/g/pack/pack2176.log | grep -v "^ " | cut -c1-240 | tail -25
