# Issue 32's calibrate (Qwen3-1.7B's shape, micro-batches of 4) from /tmp/run/camp (the
# same commit, with .gpu/megatron), once the suite's GPU part (tests/test_gpu.py) is over,
# beside the suite's CPU-only tail.
set -u; G=/tmp/g; cd /tmp/run/camp; export AMEM_COMMIT=$(cat COMMIT)
log() { echo "$(date -u +%T) up=$(cut -d' ' -f1 /proc/uptime) $*"; }
until grep -q "tests/test_gpu_drivers_on_cpu.py" $G/suite.log 2>/dev/null || [ -e $G/suite.rc ]; do sleep 5; done
log "suite's GPU part over"
python3 -c "import sys; sys.path.insert(0, '.'); from tests.gpu import megatron_runs as r; r.install_bundle()" || { log "bundle failed"; touch $G/chain.done; exit 1; }
python3 -c "import torch; x = torch.empty(9 << 30, dtype=torch.uint8, pin_memory=True); del x" && touch $G/.warm
python3 experiments/rollout_gain.py plan --preset qwen3_1_7b > $G/plan.txt 2>&1
bash experiments/campaign.sh start calib -- python3 experiments/rollout_gain.py calibrate $G/gain --preset qwen3_1_7b
until [ -e $G/calib.rc ]; do sleep 5; done; log "calib rc=$(cat $G/calib.rc)"
touch $G/chain.done
