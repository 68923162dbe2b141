set -x
export PIP_CONSTRAINT=/dev/null
rm -rf /tmp/v312 && /root/.pyenv/versions/3.12.1/bin/python -m venv /tmp/v312 && . /tmp/v312/bin/activate
# an image-like base: the packages the GPU image has that vLLM/trl need (IN_IMAGE), at its versions where known
pip install -q "torch==2.11.0" "torchaudio==2.11.0" "transformers==5.17.0" "accelerate==1.15.0" "numpy==2.5.2" "tokenizers==0.23.2" "safetensors==0.8.0" "tiktoken==0.14.0" "sentencepiece==0.2.2" "huggingface_hub==1.33.0" regex psutil requests certifi tqdm py-cpuinfo protobuf aiohttp multidict prometheus-client pillow typing-extensions filelock opencv-python-headless pyyaml six setuptools einops cloudpickle ninja numba pyarrow pandas xxhash fsspec jinja2 httpx anyio annotated-doc packaging sympy networkx cuda-bindings || exit 1
# the bundle on top, as on the GPU machine: --target a site that shadows through PYTHONPATH
pip install -q --no-index --no-deps --no-compile --target /tmp/v312-site /work/main/.gpu/vllm-wheels/*.whl || exit 1
echo base-and-bundle-installed
