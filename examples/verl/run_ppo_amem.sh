#!/usr/bin/env bash
# GRPO on GSM8K with verl 0.9.1 and vLLM, colocated, with amem_callbacks freeing
# the training workers' idle NCCL memory while vLLM generates.
#
# Needs GPUs, NCCL >= 2.29.7 in the training workers, and
#   pip install "amem-callbacks[verl]" vllm
# in the environment of every Ray node (that installs the verl.plugins entry
# point; nothing else is needed). GSM8K parquet files as made by verl's
# examples/data_preprocess/gsm8k.py, in $DATA.
#
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct DATA=~/data/gsm8k NGPUS=2 bash examples/verl/run_ppo_amem.sh
#
# Extra arguments go to verl (hydra overrides); "--cfg job" prints the config
# and exits. The amem/... figures appear in the console logger next to verl's.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
DATA="${DATA:-$HOME/data/gsm8k}"
NGPUS="${NGPUS:-2}"

python3 -m verl.trainer.main_ppo \
    --config-path "$HERE" --config-name amem_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.nnodes=1 \
    trainer.total_training_steps=20 \
    trainer.val_before_train=false \
    trainer.test_freq=-1 \
    trainer.save_freq=-1 \
    trainer.logger='["console"]' \
    "$@"
