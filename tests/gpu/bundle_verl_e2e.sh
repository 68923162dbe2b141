#!/usr/bin/env bash
# The wheels verl 0.9.1's end-to-end GRPO job (tests/gpu/verl_e2e.py) needs on the GPU
# machine beyond its image, cut into parts of one device call each (tests/gpu/vllm_bundle.py
# splits, receives and installs them, as for the vLLM bundle):
#
#   bash tests/gpu/bundle_verl_e2e.sh     # downloads from PyPI (about 425 MB: 10 calls)
#
# The list: an import audit (session Q) in a Python 3.12 venv imitating the image (torch
# 2.11.0+cu130, transformers 5.17), these wheels installed --no-deps on top: 30 of the 31
# modules verl's job reaches import (verl.trainer.main_ppo and its v1 trainer,
# engine_workers, the vLLM async server, vllm.entrypoints.openai.api_server, vllm.v1's
# engine, worker and model runner, Qwen2, FlashAttention, ray, transfer_queue); the 31st,
# vllm.device_allocator.cumem, needs the CUDA driver. vLLM's FastAPI app builds its routes.
# - torch does not travel: vLLM 0.24.0 pins torch 2.11.0, the image's.
# - verl installs --no-deps (vllm_bundle's install does so for every wheel): its metadata
#   caps transformers below the image's 5.17, which the job runs with.
# - xgrammar 0.2.3: the newest that imports beside vLLM's apache-tvm-ffi==0.1.9 pin (0.2.9
#   crashes at import with it).
# - Not carried, nothing on this path imports them at module level: flashinfer (the job
#   sets VLLM_USE_FLASHINFER_SAMPLER=0; vLLM's sampler would import it), the CuTe-DSL,
#   tilelang, tokenspeed, humming and quack kernels, compressed-tensors, the structured
#   output backends but xgrammar and llguidance, anthropic, mcp, opentelemetry, wandb
#   (the job logs to the console and a file), Ray's dashboard extras.
# - antlr4-python3-runtime 4.9.3 (omegaconf 2.3's pin) is a source archive on PyPI: its
#   pure-Python wheel is built here.
# There, one call per part (.gpu/verl_e2e/COMMANDS.txt), then
#   eval "$(python3 tests/gpu/vllm_bundle.py env --site /tmp/site-verl)"
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=.gpu/verl_e2e-wheels
DEST=.gpu/verl_e2e
NCCL_XZ=${NCCL_XZ:-.nccl/libnccl.so.2.xz}
PINS=(
  vllm==0.24.0 ray==2.60.0 verl==0.9.1 transferqueue==0.1.11
  xgrammar==0.2.3 apache-tvm-ffi==0.1.9 llguidance==1.7.6 openai-harmony==0.0.8
  pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  openai==2.54.0 distro==1.9.0 sniffio==1.3.1
  pyzmq==27.3.0 msgspec==0.23.0 cbor2==6.3.0 pybase64==1.5.1 cachetools==8.0.3
  fastapi==0.136.3 starlette==1.10.0 uvicorn==0.55.0 watchfiles==1.3.0
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 partial-json-parser==0.2.1.1.post7
  prometheus-fastapi-instrumentator==8.1.0
  jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
  tensordict==0.10.0 orjson==3.13.0 pyvers==0.1.0
  hydra-core==1.3.8 omegaconf==2.3.1 codetiming==1.4.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchdata==0.11.0
  depyf==0.20.0 astor==0.8.1
)
mkdir -p "$WHEELS"
PIP_CONFIG_FILE=/dev/null PIP_CONSTRAINT=/dev/null python3 -m pip download -q --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$WHEELS" "${PINS[@]}"
ls "$WHEELS"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 || \
  PIP_CONFIG_FILE=/dev/null python3 -m pip wheel -q --no-deps -w "$WHEELS" antlr4-python3-runtime==4.9.3
[[ -f "$NCCL_XZ" ]] || ../shared/tools/device-nccl "$(dirname "$NCCL_XZ")" 2.30.7 90
cp "$NCCL_XZ" "$WHEELS"/libnccl.so.2.xz
count=$(ls "$WHEELS"/*.whl | wc -l)
[[ "$count" -eq $(( ${#PINS[@]} + 1 )) ]] || { echo "$WHEELS holds $count wheels for \
$(( ${#PINS[@]} + 1 )) pins: remove the folder and run again" >&2; exit 1; }

python3 tests/gpu/vllm_bundle.py split "$WHEELS" "$DEST" --no-pins
python3 tests/gpu/vllm_bundle.py commands "$DEST" --store /tmp/verl-parts --site /tmp/site-verl \
  > "$DEST"/COMMANDS.txt
echo "device calls: $DEST/COMMANDS.txt"
