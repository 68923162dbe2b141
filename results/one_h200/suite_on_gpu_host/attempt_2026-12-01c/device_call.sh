set -u; R=/tmp/run; T=$R/tree; mkdir -p $R/soak; rm -rf $T; cp -r .stage/clean $T; cd $T
export AMEM_COMMIT=$(cat COMMIT)
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
S=$OUT/setup.log
{ date -u; cat /proc/uptime; nproc; free -g; ulimit -a; cat /sys/fs/cgroup/pids.max 2>&1; command -v python python3; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo commit=$AMEM_COMMIT; } > $S 2>&1
PY=python3; command -v python >/dev/null && PY=python; echo "PY=$PY" >> $S
( time $PY -m pip install -q --no-deps --no-build-isolation -e . ) >> $S 2>&1
NCCL_MULTI_RANK_GPU_ENABLE=1 LD_PRELOAD=/tmp/nccl/libnccl.so.2 timeout 240 $PY -m torch.distributed.run --nproc-per-node 2 tests/gpu/cold_host_gpu.py $OUT/cold.json > $OUT/cold.log 2>&1; echo "rc=$? uptime=$(cat /proc/uptime)" >> $OUT/cold.log
bash experiments/campaign.sh start suite -- $PY -m pytest -ra --durations=40
bash experiments/campaign.sh start soak NCCL_MULTI_RANK_GPU_ENABLE=1 -- $PY tests/gpu/soak_gpu.py --out $R/soak/soak.json --ranks 2 --seconds 1200 --cycles 1100 --min-cycles 1000 --shared-gpu
echo "started at $(cat /proc/uptime)" >> $S
for i in $(seq 1 200); do cp /tmp/g/suite.log /tmp/g/soak.log $OUT/ 2>/dev/null; [ $SECONDS -gt 540 ] && break; [ -e /tmp/g/suite.rc ] && [ -e /tmp/g/soak.rc ] && break; sleep 10; done
tail -3 $OUT/cold.log; tail -4 /tmp/g/suite.log; tail -3 /tmp/g/soak.log; ls /tmp/g

# --- the next two device calls (no carry), polled while both ran ---
# call 2: for i in $(seq 1 200); do cp /tmp/g/suite.log /tmp/g/soak.log $OUT/ 2>/dev/null; [ $SECONDS -gt 560 ] && break; [ -e /tmp/g/suite.rc ] && [ -e /tmp/g/soak.rc ] && break; sleep 10; done
# call 3: cd /tmp/run/tree; for i in $(seq 1 60); do [ -e /tmp/g/soak.rc ] && break; sleep 5; done; cp /tmp/g/soak.log $OUT/; cp /tmp/run/soak/soak.json /tmp/run/soak/soak.png $OUT/; tar czf $OUT/soak_ranks.tgz -C /tmp/run/soak soak_ranks; F=$(grep -oE '^(FAILED|ERROR) tests/[^ :]+' /tmp/g/suite.log | awk '{print $2}' | sort -u); LD_PRELOAD=/tmp/nccl/libnccl.so.2 timeout 250 python -m pytest -ra -x -q $F > $OUT/rerun.log 2>&1
# The tree was `git archive 88c5c22` with .nccl/libnccl.so.2.xz (../shared/tools/device-nccl .nccl 2.30.7) and COMMIT, carried as .stage/clean.
