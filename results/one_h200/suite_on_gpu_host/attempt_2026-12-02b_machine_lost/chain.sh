# Issue 32's session-0 steps beside and after the suite (call1.sh), from /tmp/run/camp
# (the same commit, with .gpu/megatron). calibrate is a memory measurement first: it
# starts once the suite's GPU part (tests/test_gpu.py) is over, beside its CPU-only
# tail; the curve (timed) runs after the suite alone, its own launch-buffer point
# first (then the grown size, then half the launch requests): a lease that ends
# mid-curve keeps the points it finished.
set -u; G=/tmp/g; cd /tmp/run/camp; export AMEM_COMMIT=$(cat COMMIT)
log() { echo "$(date -u +%T) up=$(cut -d' ' -f1 /proc/uptime) $*"; }
until grep -q "tests/test_gpu_drivers_on_cpu.py" $G/suite.log 2>/dev/null || [ -e $G/suite.rc ]; do sleep 5; done
log "suite's GPU part over"
# campaign.sh setup's steps but the package install: the suite runs on /tmp/run/tree's
python3 -c "import sys; sys.path.insert(0, '.'); from tests.gpu import megatron_runs as r; r.install_bundle()" || { log "bundle failed"; exit 1; }
python3 -c "import torch; x = torch.empty(9 << 30, dtype=torch.uint8, pin_memory=True); del x" && touch $G/.warm
bash experiments/campaign.sh start calib -- python3 experiments/rollout_gain.py calibrate $G/gain --preset qwen3_1_7b
until [ -e $G/calib.rc ]; do sleep 5; done; log "calib rc=$(cat $G/calib.rc)"
until [ -e $G/suite.rc ]; do sleep 5; done; log "suite rc=$(cat $G/suite.rc)"
bash experiments/campaign.sh setup > $G/setup_camp.log 2>&1; log "setup rc=$?"
PTS=$(python3 -c "import sys; sys.path[:0]=['experiments','.']; import rollout_gain as g, presets as p; q=p.PRESETS['qwen3_1_7b']; print(' '.join(['%g' % q.buffer_gb] + g.default_points(q)))")
log "curve points: $PTS"
bash experiments/campaign.sh start curve -- python3 experiments/rollout_gain.py curve $G/gain --preset qwen3_1_7b --points $PTS
until [ -e $G/curve.rc ]; do sleep 5; done; log "curve rc=$(cat $G/curve.rc)"
L=$(python3 -c "import json;print(json.load(open('$G/gain/calibration.json'))['leave_gb'])") || { log "no leave_gb"; touch $G/chain.done; exit 1; }
log "control leave_gb=$L"
bash experiments/campaign.sh start control -- sh -c "python3 experiments/rollout_gain.py run $G/gain --preset qwen3_1_7b --pairs 0 --control --leave-gb $L && python3 experiments/rollout_gain.py merge $G/gain"
until [ -e $G/control.rc ]; do sleep 5; done; log "control rc=$(cat $G/control.rc)"
touch $G/chain.done
