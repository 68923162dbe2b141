#!/usr/bin/env bash
# Fill the ignored folder .gpu/torch<VER> with what a torch newer than the GPU image's
# needs there, cut into parts of one device call each (tests/gpu/vllm_bundle.py does
# the packing, cutting, receiving and installing, as for the vLLM bundle):
#
#   bash tests/gpu/bundle_torch.sh              # torch 2.15.0 (the default), from PyPI
#   TORCH_VERSION=2.15.0 NVSHMEM_VERSION=3.7.2 bash tests/gpu/bundle_torch.sh
#
# What travels and why (read on the CPU with Python's RTLD_NOW, docs/evidence.md):
# - the torch wheel (2.15.0+cu132; the image has 2.11.0+cu130). It loads the image's
#   CUDA 13 libraries from nvidia/*/lib on sys.path (same major), but not its nvshmem:
# - nvidia-nvshmem-cu13's host libraries: torch 2.15's libtorch_nvshmem.so binds
#   nvshmem 3.7's symbols at import (the image has 3.4.5). Only lib/*.so* travel, in a
#   wheel re-written without the device bitcode, headers and static libraries
#   (135 MB -> about 50 MB): torch preloads libnvshmem_host.so.3 at import, nothing else.
# - NCCL 2.30.7 (../shared/tools/device-nccl): 2.15's libtorch_cuda binds
#   ncclCommResume, which the image's 2.28.9 lacks; several ranks on one GPU need 2.30.
#
# There, one call per part, back to back (.gpu/torch<VER>/COMMANDS.txt), then:
#   eval "$(python3 tests/gpu/vllm_bundle.py env --site /tmp/site-torch<VER>)"
set -euo pipefail
cd "$(dirname "$0")/../.."
TORCH_VERSION=${TORCH_VERSION:-2.15.0}
NVSHMEM_VERSION=${NVSHMEM_VERSION:-3.7.2}
NCCL_XZ=${NCCL_XZ:-.nccl/libnccl.so.2.xz}
TAG=torch${TORCH_VERSION//./}
WHEELS=.gpu/$TAG-wheels
DEST=.gpu/$TAG
mkdir -p "$WHEELS"

# PIP_CONFIG_FILE / PIP_CONSTRAINT: this machine caps torch below 2.15 for its own
# installs; these wheels are for the GPU machine (Python 3.12), not for here.
download() {
    PIP_CONFIG_FILE=/dev/null PIP_CONSTRAINT=/dev/null python3 -m pip download -q --no-deps \
        --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$1" "$2"
}
ls "$WHEELS"/torch-"$TORCH_VERSION"-cp312-*.whl >/dev/null 2>&1 || download "$WHEELS" "torch==$TORCH_VERSION"
slim="$WHEELS/nvidia_nvshmem_cu13-$NVSHMEM_VERSION-py3-none-any.whl"
if [[ ! -f "$slim" ]]; then
    tmp=$(mktemp -d)
    download "$tmp" "nvidia-nvshmem-cu13==$NVSHMEM_VERSION"
    python3 tests/gpu/slim_wheel.py "$tmp"/nvidia_nvshmem_cu13-*.whl "$slim" 'nvidia/nvshmem/lib/*.so*'
    rm -r "$tmp"
fi
if [[ ! -f "$NCCL_XZ" ]]; then
    ../shared/tools/device-nccl "$(dirname "$NCCL_XZ")" 2.30.7 90
fi
cp "$NCCL_XZ" "$WHEELS"/libnccl.so.2.xz

# Not packed (vllm_bundle.py pack): torch's wheel re-written stored and xz'd saves about
# a fifth (3 of 15 calls) for 10-20 minutes of xz on two cores: split as downloaded.
python3 tests/gpu/vllm_bundle.py split "$WHEELS" "$DEST" --no-pins

python3 tests/gpu/vllm_bundle.py commands "$DEST" --store "/tmp/$TAG-parts" \
    --site "/tmp/site-$TAG" > "$DEST"/COMMANDS.txt
echo "device calls: $DEST/COMMANDS.txt"
