#!/usr/bin/env bash
# Megatron-LM GRPO with the NCCL memory of idle process groups freed during rollout.
#
# Run from a Megatron-LM checkout, with amem-callbacks installed
# (pip install "amem-callbacks[megatron]") and NCCL >= 2.29.7 loaded by torch.
# The only changes to a usual train_rl.py command: "-m amem_callbacks.adapters.megatron"
# before the script, and the --rl-amem-* flags anywhere among its arguments.
#
#   NPROC=8 bash run_grpo_with_amem.sh --tensor-model-parallel-size 2 ... (your usual flags)
#
# Flags are those of megatron-core >= 0.17 (0.19.2 today): the in-process inference
# server is the only one, so 0.16's --langrl-inference-server-type is gone. The
# KV cache mode "recompute" (or "offload") frees the KV cache between rollouts;
# the default "persist" keeps it, and then freed NCCL memory cannot serve it.
set -euo pipefail

torchrun --nproc-per-node "${NPROC:-8}" \
    -m amem_callbacks.adapters.megatron train_rl.py \
    --perform-rl-step \
    --rl-kv-cache-management-mode "${KV_CACHE_MODE:-recompute}" \
    --rl-amem-offload-during-rollout \
    --rl-amem-backend "${AMEM_BACKEND:-auto}" \
    "$@"
# Options:
#   --rl-amem-backend {auto,nccl,amem,noop}   noop: dry run, logs what would be suspended
#   --rl-amem-keep-groups dp,world            keep more parallel_state groups active
#   --rl-amem-group-id N                      AMem only (ncclSetGroupID)
