#!/usr/bin/env bash
# Wheels that tests/gpu/verl_gpu.py needs on the GPU machine and its image
# lacks, into .gpu/verl/ (ignored by git; carried to the machine). Works on a
# clean clone with PyPI reachable:
#     tests/gpu/bundle_verl.sh            # -> .gpu/verl/*.whl (about 6.5 MB)
#     VERL_WHEELS_FROM=DIR tests/gpu/bundle_verl.sh   # copy from DIR instead (offline)
#
# The GPU image: Python 3.12, torch 2.11, transformers 5.17, tokenizers 0.23,
# accelerate, peft, numpy, pandas, pyarrow, safetensors, huggingface_hub,
# pyyaml, psutil, packaging, cloudpickle, pybind11, tensorboard are there.
# Not carried: ray (~79 MB; verl only imports it on this path, and
# tests/standins/ray stands in), wandb, torchdata and pylatexenc (verl declares
# them; nothing on this path imports them). verl 0.9.1 declares
# transformers<5.11; its worker path ran unchanged with 5.17 (CPU smoke), so no
# transformers wheel is carried.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.gpu/verl

# name==version, each needed to import or run verl's ActorRolloutRefWorker path
PINS=(
    verl==0.9.1
    tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0  # tensordict's (its importlib-metadata: unused)
    omegaconf==2.3.1 hydra-core==1.3.8          # configs (+ antlr4 4.9.3 below)
    codetiming==1.4.0                           # timers in the FSDP engine
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5
    fastapi==0.141.1 starlette==0.52.1 uvicorn==0.52.3  # imported via checkpoint_engine
    datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1   # imported via verl.utils.dataset
)
ANTLR=antlr4-python3-runtime==4.9.3  # omegaconf 2.3 pins it; PyPI has only its sdist

rm -rf "$DEST" && mkdir -p "$DEST"
if [[ -n "${VERL_WHEELS_FROM:-}" ]]; then
    for pin in "${PINS[@]}" "$ANTLR"; do
        name=${pin%%==*}; version=${pin##*==}
        file=$(ls "$VERL_WHEELS_FROM"/"${name//-/_}"-"$version"-*.whl 2>/dev/null | head -1)
        [[ -n "$file" ]] || { echo "missing in $VERL_WHEELS_FROM: $pin" >&2; exit 1; }
        cp "$file" "$DEST"/
    done
else
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$DEST" "${PINS[@]}"
    python3 -m pip wheel -q --no-deps -w "$DEST" "$ANTLR"  # pure Python: py3-none-any
fi
ls -l "$DEST"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sb "$DEST" | cut -f1) bytes in $DEST"
