# Session 2026-12-02c, call 1 (carry .stage .nccl .gpu/megatron): the README's test command
# on the GPU host in /tmp/run/tree (a clean export of HEAD: no .gpu), detached; chain.sh
# runs issue 32's calibrate from a second export, /tmp/run/camp, once the suite's GPU part
# is over. poll.sh copies what both have to $OUT.
set -u; R=/tmp/run; T=$R/tree; C=$R/camp; rm -rf $T $C; mkdir -p $R /tmp/g
cp .stage/*.sh $R/; cp -r .stage/clean $T; cp -r .nccl $T/; cp -r .stage/clean $C; cp -r .nccl .gpu $C/
cd $T; export AMEM_COMMIT=$(cat COMMIT)
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
S=$OUT/setup.log
{ date -u; cat /proc/uptime; nproc; free -g; command -v python python3; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; echo commit=$AMEM_COMMIT; } > $S 2>&1
PY=python3; command -v python >/dev/null && PY=python; echo "PY=$PY" >> $S
( time $PY -m pip install -q --no-deps --no-build-isolation -e . ) >> $S 2>&1
LD_PRELOAD=/tmp/nccl/libnccl.so.2 $PY -c "import torch; print('torch', torch.__version__)" >> $S 2>&1
bash experiments/campaign.sh start suite -- $PY -m pytest -ra --durations=40
echo "suite started at $(cat /proc/uptime)" >> $S; cp $S /tmp/g/setup.log
setsid bash $R/chain.sh > /tmp/g/chain.log 2>&1 < /dev/null &
bash $R/poll.sh 530 /tmp/g/suite.rc
