#!/usr/bin/env bash
# The rollout-gain campaign's steps on the GPU machine (experiments/NEXT_GPU_CAMPAIGN.md
# has the device calls). Each device call is at most 10 minutes, so a step runs detached
# (setsid: it outlives the call while the machine is held) and calls poll it; every poll
# copies what the step has so far to $OUT, so a machine lost between calls loses only
# the run in progress.
#
#   bash experiments/campaign.sh setup                  # NCCL, the bundle, machine.txt; once a machine
#   bash experiments/campaign.sh start NAME [VAR=VALUE ...] -- COMMAND...
#   bash experiments/campaign.sh wait NAME DIR SECONDS  # 0: done (its rc in the log), 3: still running,
#                                                     # 4: not on this machine (a fresh one)
#
# NAME's log is /tmp/g/NAME.log, its exit status /tmp/g/NAME.rc; DIR is the folder the
# step writes (its runs.tgz, JSON and plot come back). VAR=VALUE pairs (CUDA_VISIBLE_DEVICES=1)
# go to the step's environment.
set -uo pipefail
cd "$(dirname "$0")/.."
G=${AMEM_CAMPAIGN_DIR:-/tmp/g}  # every step's folder (a test points it elsewhere)
mkdir -p "$G"
what=${1:?setup, start or wait}; shift

case $what in
setup)
    if [ ! -e /tmp/nccl/libnccl.so.2 ]; then  # ../shared/tools/device-nccl's file, carried as .nccl
        mkdir -p /tmp/nccl
        python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2.part','wb'))" \
            && mv /tmp/nccl/libnccl.so.2.part /tmp/nccl/libnccl.so.2 || exit 1
    fi
    # the package as users install it (adapters/ becomes amem_callbacks.adapters); no registry there
    python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
    python3 -c "import sys; sys.path.insert(0, '.'); from experiments import gpu_runs as r; r.install_bundle()" \
        || exit 1
    if [ ! -e $G/.warm ]; then
        # A freshly started host took 16.4 s for its first suspend of 4.5 GiB a rank (NCCL
        # pins a host backup of every byte; 0.7 s/GiB warm; FIELD-NOTES section 8): pin and
        # free what both ranks will, once, before anything is timed.
        python3 -c "import torch; x = torch.empty(9 << 30, dtype=torch.uint8, pin_memory=True); del x" \
            && touch $G/.warm
    fi
    { nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
      python3 -c "import torch, sys; print(torch.__version__, sys.version.split()[0], torch.cuda.device_count(), 'GPUs')"
      # the loaded library's own version (torch.cuda.nccl.version() is the one torch was built with)
      LD_PRELOAD=/tmp/nccl/libnccl.so.2 python3 -c "import torch, torch.distributed; from amem_callbacks.nccl_library import NcclLibrary; print('NCCL loaded', getattr(NcclLibrary.loaded(), 'version_str', None))"
    } > "${OUT:-$G}/machine.txt" 2>&1
    cat "${OUT:-$G}/machine.txt"
    ;;
start)
    name=${1:?NAME}; shift
    vars=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do vars+=("$1"); shift; done
    shift  # the --
    rm -f "$G/$name.rc"
    : > "$G/$name.log"  # started here, before the detached shell runs: a wait at once sees it
    [ -e /tmp/nccl/libnccl.so.2 ] && vars=(LD_PRELOAD=/tmp/nccl/libnccl.so.2 "${vars[@]}")
    # its own session and no file of this call's: the call returns at once
    PYTHONUNBUFFERED=1 setsid env "${vars[@]}" bash -c \
        '"$@" > '"$G/$name.log"' 2>&1; echo $? > '"$G/$name.rc" _ "$@" \
        < /dev/null > /dev/null 2>&1 &
    echo "started $name: $*"
    ;;
wait)
    name=${1:?NAME}; dir=${2:?DIR}; seconds=${3:-540}
    if [ ! -e "$G/$name.log" ] && [ ! -e "$G/$name.rc" ]; then
        # A fresh machine (the held one went back between two calls): nothing of the step
        # is here, so waiting would only spend device time (2026-12-04 lost 580 s that way).
        echo "$name: never started on this machine (the machine that ran it went back);" \
             "what came back from the last wait is all there is: start again"
        exit 4
    fi
    deadline=$((SECONDS + seconds))
    while [ ! -e "$G/$name.rc" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    if [ -n "${OUT:-}" ]; then  # at most 8 files come back
        cp "$G/$name.log" "$OUT/" 2>/dev/null
        for f in runs.tgz calibration.json curve.json rollout_gain.json critical_path.json \
                 memory_pair0.png; do
            [ -e "$dir/$f" ] && cp "$dir/$f" "$OUT/"
        done
    fi
    tail -n 25 "$G/$name.log"
    if [ -e "$G/$name.rc" ]; then echo "$name: done, rc=$(cat "$G/$name.rc")"; exit 0; fi
    echo "$name: still running (call wait again at once)"; exit 3
    ;;
*) echo "unknown step '$what' (setup, start or wait)"; exit 2 ;;
esac
