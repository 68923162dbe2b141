#!/usr/bin/env bash
# Fill the ignored folder .gpu/vllm with what a colocated vLLM 0.31 in TRL 1.16's
# GRPOTrainer needs on the GPU machine beyond its image, cut into parts that fit
# one device call each (64 MiB per call, the working tree included):
#
#   bash tests/gpu/bundle_vllm.sh            # downloads from PyPI (about 1.1 GB; packed 0.8)
#   WHEELS_FROM=DIR bash tests/gpu/bundle_vllm.sh   # copies the wheels from DIR instead
#   WHEELS_FROM=.gpu/vllm-wheels bash tests/gpu/bundle_vllm.sh   # re-cut only (offline)
#
# Re-cut right before the device calls: the part size is what a call carries
# beside the working tree as it is now (tests/gpu/vllm_bundle.py part_bytes_for).
#
# What travels and why: CARRIED in tests/gpu/vllm_bundle.py (vLLM 0.31.0, the newest
# trl 1.16 supports; torch 2.13.0, triton 3.7.1, torchvision 0.28.0, trl, datasets and
# the small packages vLLM imports on that path), plus NCCL 2.30.7 (several ranks on one GPU need
# >= 2.30) from ../shared/tools/device-nccl. Every requirement of the vLLM wheel must
# be carried, in the image or named in NOT_CARRIED with a reason, or this stops.
#
# Out: .gpu/vllm/part-NN/{part-NN.bin,manifest.json}, .gpu/vllm/manifest.json (file,
# size, sha256, offset, parts) and .gpu/vllm/COMMANDS.txt: the device calls in order,
# each carrying one part folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=.gpu/vllm-wheels   # the downloads (ignored: .gpu/)
DEST=.gpu/vllm            # the parts that travel
NCCL_XZ=${NCCL_XZ:-.nccl/libnccl.so.2.xz}
NCCL_VERSION=2.30.7
mkdir -p "$WHEELS"

mapfile -t PINS < <(python3 tests/gpu/vllm_bundle.py pins)
if [[ -n "${WHEELS_FROM:-}" && "$(realpath "$WHEELS_FROM")" == "$(realpath "$WHEELS")" ]]; then
    :  # the downloads are already where they go: only the checks and the cut below
elif [[ -n "${WHEELS_FROM:-}" ]]; then
    for pin in "${PINS[@]}"; do
        name=${pin%%==*}; version=${pin##*==}
        file=$(ls "$WHEELS_FROM"/"${name//-/_}"-"$version"-*.whl "$WHEELS_FROM"/"$name"-"$version"-*.whl \
               2>/dev/null | head -1 || true)
        [[ -n "$file" ]] || { echo "missing in $WHEELS_FROM: $pin" >&2; exit 1; }
        cp -n "$file" "$WHEELS"/
    done
else
    # PIP_CONSTRAINT=/dev/null: this machine's pip caps torch at 2.14.1 by a constraint
    # file; the wheels are for the GPU machine (Python 3.12, glibc 2.39), not for here.
    # manylinux_2_31: llguidance 1.7's only Linux x86-64 wheel.
    PIP_CONSTRAINT=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$WHEELS" "${PINS[@]}"
fi

# Exactly one wheel per pin, nothing else: two versions of one package stop pip there.
python3 - "$WHEELS" "${PINS[@]}" <<'PY'
import os, sys
sys.path.insert(0, "tests/gpu")
from vllm_bundle import canonical
folder, pins = sys.argv[1], sys.argv[2:]
want = {canonical(p.split("==")[0]): p.split("==")[1] for p in pins}
found = {}
for name in os.listdir(folder):
    if name.endswith(".whl"):
        dist, version = name.split("-")[:2]
        found.setdefault(canonical(dist), []).append((version, name))
extra = sorted(set(found) - set(want))
missing = sorted(set(want) - set(found))
wrong = sorted(f"{d}: {[v for v, _ in found[d]]} (want {want[d]})" for d in set(want) & set(found)
               if [v for v, _ in found[d]] != [want[d]])
if extra or missing or wrong:
    sys.exit(f"{folder}: not one wheel per pin: extra {extra}, missing {missing}, wrong {wrong}: "
             "remove the folder and run again")
PY
python3 tests/gpu/vllm_bundle.py audit "$WHEELS"/vllm-"$(python3 tests/gpu/vllm_bundle.py version vllm)"-*.whl

if [[ ! -f "$NCCL_XZ" ]]; then
    ../shared/tools/device-nccl "$(dirname "$NCCL_XZ")" "$NCCL_VERSION" 90
fi
# the library names its version in its banner string
found=$(python3 -c "import lzma,re,sys; d=lzma.open(sys.argv[1]).read(); \
m=re.search(rb'NCCL version (2\.[0-9]+\.[0-9]+)', d); print(m.group(1).decode() if m else '')" "$NCCL_XZ")
[[ "$found" == "$NCCL_VERSION" ]] || { echo "$NCCL_XZ is NCCL '$found', not $NCCL_VERSION: \
rebuild it with ../shared/tools/device-nccl .nccl $NCCL_VERSION 90" >&2; exit 1; }
cp "$NCCL_XZ" "$WHEELS"/libnccl.so.2.xz

# Each wheel re-written stored and xz'd whole: about 30 % fewer bytes, so fewer calls
# (vllm_bundle.pack; about 15 minutes of xz for the whole set here, seconds of lzma
# there). A file packed before from the same bytes is kept (packed-from.json), so a
# re-cut after a change to the tree or one added wheel takes seconds.
PACKED=.gpu/vllm-packed
rm -f "$PACKED.from"   # the whole-set digest this replaced
python3 tests/gpu/vllm_bundle.py pack "$WHEELS" "$PACKED"
python3 tests/gpu/vllm_bundle.py split "$PACKED" "$DEST"

# The device calls, in order: one part folder each, back to back (the machine keeps
# /tmp only while it stays warm between calls).
python3 tests/gpu/vllm_bundle.py commands "$DEST" --check > "$DEST"/COMMANDS.txt
echo "device calls: $DEST/COMMANDS.txt"
