#!/usr/bin/env bash
# Fill the ignored folder .gpu/megatron with what Megatron-LM's RL loop needs on the
# GPU machine (it reaches no registry): the megatron-core 0.19.2 wheel, the wheels of
# the RL runtime that the GPU image lacks (pinned to Megatron-LM's uv.lock), and the
# few Megatron-LM files the wheel does not ship (megatron/rl, megatron/inference,
# train_rl.py and its builders) from the release branch of the installed version.
#
#   bash tests/gpu/bundle_megatron.sh [MEGATRON_LM_GIT_DIR_OR_URL]
#
# The Megatron-LM files are NVIDIA's; they travel to the GPU machine and are never
# committed here (.gpu/ is ignored). About 9 MB in all.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.gpu/megatron
SRC=${1:-${MEGATRON_LM:-https://github.com/NVIDIA/Megatron-LM}}
REF=${MEGATRON_LM_REF:-core_r0.19.0}   # megatron-core 0.19.2 is cut from this branch
mkdir -p "$DEST/wheels" "$DEST/mlm"

PINS="megatron-core==0.19.2
pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.4
openai==2.54.0 distro==1.9.0 jiter==0.16.0 sniffio==1.3.1 httpx-aiohttp==0.2.0
fastapi==0.141.1 starlette==0.52.1 uvicorn==0.52.3 pyzmq==27.3.0
quart==0.21.0 hypercorn==0.18.0 flask==3.1.3 blinker==1.9.0 itsdangerous==2.2.0
h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2"
# openai 3.x moved to httpx2 and newer fastapi imports opentelemetry: keep these pins.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST/wheels" $PINS

FILES="train_rl.py model_provider.py gpt_builders.py hybrid_builders.py megatron/rl megatron/inference"
# The wheel ships the compiled dataset helpers but not their Makefile, and
# train_rl.py's initialisation runs `make` there on rank 0 (a checkout has it).
MAKEFILE=megatron/core/datasets/Makefile
if [ -d "$SRC" ] && git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$SRC" archive "$REF" $FILES | tar -x -C "$DEST/mlm"
    git -C "$SRC" show "$REF:$MAKEFILE" > "$DEST/datasets.Makefile"
    git -C "$SRC" rev-parse "$REF" > "$DEST/mlm/SOURCE_COMMIT"
else
    tmp=$(mktemp -d)
    git clone -q --depth 1 --branch "$REF" --filter=blob:none --sparse "$SRC" "$tmp"
    git -C "$tmp" sparse-checkout set $FILES megatron/core/datasets
    (cd "$tmp" && tar -c $FILES) | tar -x -C "$DEST/mlm"
    cp "$tmp/$MAKEFILE" "$DEST/datasets.Makefile"
    git -C "$tmp" rev-parse HEAD > "$DEST/mlm/SOURCE_COMMIT"
    rm -rf "$tmp"
fi
du -sh "$DEST"
