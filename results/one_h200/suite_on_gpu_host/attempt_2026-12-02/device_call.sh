set -u; R=/tmp/run; T=$R/tree; mkdir -p $R/soak; rm -rf $T; cp -r .stage/clean $T; cp -r .nccl $T/; cd $T
export AMEM_COMMIT=$(cat COMMIT)
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
S=$OUT/setup.log
{ date -u; cat /proc/uptime; nproc; free -g; command -v python python3; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo commit=$AMEM_COMMIT; } > $S 2>&1
PY=python3; command -v python >/dev/null && PY=python; echo "PY=$PY" >> $S
( time $PY -m pip install -q --no-deps --no-build-isolation -e . ) >> $S 2>&1
LD_PRELOAD=/tmp/nccl/libnccl.so.2 $PY -c "import torch; print('torch', torch.__version__, 'NCCL', torch.cuda.nccl.version())" >> $S 2>&1
bash experiments/campaign.sh start suite -- $PY -m pytest -ra --durations=40
bash experiments/campaign.sh start soak NCCL_MULTI_RANK_GPU_ENABLE=1 -- $PY tests/gpu/soak_gpu.py --out $R/soak/soak.json --ranks 2 --seconds 1420 --cycles 1000 --min-cycles 1000 --shared-gpu
echo "started at $(cat /proc/uptime)" >> $S
for i in $(seq 1 200); do cp /tmp/g/suite.log /tmp/g/soak.log $OUT/ 2>/dev/null; [ $SECONDS -gt 540 ] && break; [ -e /tmp/g/suite.rc ] && [ -e /tmp/g/soak.rc ] && break; sleep 10; done
cat $S | tail -5; tail -4 /tmp/g/suite.log; tail -3 /tmp/g/soak.log; ls /tmp/g

# --- calls 2 and 3 (no carry): bash /tmp/run/tree/poll.sh 560, then 330 ---
# poll: copy the logs until both are done or LIMIT seconds have passed
LIMIT=${1:-560}
for i in $(seq 1 200); do cp /tmp/g/suite.log /tmp/g/soak.log $OUT/ 2>/dev/null; [ $SECONDS -gt $LIMIT ] && break; [ -e /tmp/g/suite.rc ] && [ -e /tmp/g/soak.rc ] && break; sleep 10; done
tail -4 /tmp/g/suite.log; tail -3 /tmp/g/soak.log; ls /tmp/g; cat /tmp/g/*.rc 2>/dev/null
if [ -e /tmp/g/soak.rc ]; then cp /tmp/run/soak/soak.json /tmp/run/soak/soak.png $OUT/ 2>/dev/null; tar czf $OUT/soak_ranks.tgz -C /tmp/run/soak soak_ranks 2>/dev/null; fi

# --- call 4 (carry .nccl), core alone three times after both had finished ---
for i in 1 2 3; do LD_PRELOAD=/tmp/nccl/libnccl.so.2 PYTHONPATH=$PWD timeout 100 python -m tests.gpu.run_all --out $OUT/core$i --small-buffers --only core; done
