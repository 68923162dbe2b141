"""vLLM 0.31 on the GPU machine: which wheels travel, how they are cut into parts
that fit one device call each, and how the parts become an installed stack there.

The GPU machine reaches no registry and takes at most 64 MiB per call, the
working tree included (/work/.library/device/README.md). Its image has Python
3.12, torch 2.11.0+cu130, transformers 5.17, accelerate 1.15, numpy, pillow,
aiohttp, prometheus-client and the CUDA 13 libraries, but no vLLM, trl,
datasets, pydantic, fastapi, openai or pyzmq.

Why vLLM 0.31.0, not the newest (0.34.0): trl 1.16.0 supports vLLM 0.22.0-0.31.0
(its ``vllm`` extra pins ``vllm<=0.31.0``, and ``trl.import_utils`` warns on any other
version), so a TRL user who installs ``trl[vllm]`` runs 0.31.0. Checked on CPU
(Python 3.12, an image-like venv, the carried wheels on top, NCCL 2.30.7 preloaded):
every colocate module imports but the two that need the CUDA driver. vLLM 0.31.0 pins
torch==2.13.0, which pins triton==3.7.1 and NCCL 2.29.7: torch, triton and
torchvision travel and shadow the image's copies through PYTHONPATH, while torch 2.13
loads the image's CUDA 13 libraries (it looks for ``nvidia/*/lib`` on sys.path;
FIELD-NOTES section 7 ran torch 2.14 there this way). NCCL 2.30.7 (several ranks on
one GPU need >= 2.30; 2.29.7 refuses them) travels as the 30 MB xz file of
``../shared/tools/device-nccl`` and is preloaded in place of torch's 2.29.7.

Here (tests/gpu/bundle_vllm.sh): ``pins`` -> pip download -> ``split``.
There, one call per part, back to back (the machine keeps /tmp only while it
stays warm, 30 s after a call)::

    python3 tests/gpu/vllm_bundle.py receive .gpu/vllm/part-00      # carry .gpu/vllm/part-00
    ...
    python3 tests/gpu/vllm_bundle.py receive .gpu/vllm/part-NN && \\
        python3 tests/gpu/vllm_bundle.py install && python3 tests/gpu/vllm_bundle.py check

``bundle_vllm.sh`` writes those lines, with the real part count, to
.gpu/vllm/COMMANDS.txt. This module uses the standard library only: on the GPU
machine it runs under the image's python3 before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Iterable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLE_DIR = os.path.join(ROOT, ".gpu", "vllm")  # ignored by git (.gitignore: /.gpu/)
STORE = "/tmp/vllm-parts"  # on the GPU machine: the parts received so far
SITE = "/tmp/site-vllm"  # on the GPU machine: the installed wheels
NCCL_DIR = "/tmp/nccl-vllm"  # on the GPU machine: the unpacked libnccl.so.2
MANIFEST = "manifest.json"
FORMAT = 1

#: what one device call may carry, the working tree included (device README)
CALL_LIMIT = 64 * 2**20
#: the part size the field notes name; smaller when the tree leaves less room
PART_CAP = 62 * 10**6
#: left free under CALL_LIMIT: the tree may grow a little between here and there
MARGIN = 2 * 2**20
_BUF = 1 << 20

# --- what travels -------------------------------------------------------------------
#: name==version -> why it travels. The image lacks the package, or has a version
#: vLLM 0.31.0 / torch 2.13.0 / trl 1.16.0 cannot run with. Module-level imports
#: below are read from the wheels' sources on the colocate path (vllm.LLM, the V1
#: engine core in-process, UniProc/external-launcher executor, gpu_worker,
#: gpu_model_runner, Qwen2, the FlashAttention backend, cumem sleep mode, the
#: weight-transfer modules trl's vllm_client imports) and confirmed by importing
#: them on CPU with only these on top of the image's packages.
CARRIED = {
    "vllm==0.31.0": "the engine, at the newest version trl 1.16.0 supports (its vllm "
                    "extra: vllm<=0.31.0)",
    "torch==2.13.0": "vLLM 0.31.0's pin: its _C and flash-attention kernels are built "
                     "against it (the image has 2.11.0)",
    "triton==3.7.1": "torch 2.13.0 pins triton==3.7.1 (inductor, vLLM's Triton kernels); "
                     "the image has 3.6.0",
    "torchvision==0.28.0": "vLLM's pin, built for torch 2.13: the image's 0.26 raises "
                           "'operator torchvision::nms does not exist' under a newer torch, and "
                           "vllm.entrypoints.llm imports torchvision (through transformers)",
    "pydantic==2.13.4": "vllm.config (module level); the version the Megatron bundle ran there",
    "pydantic-core==2.46.4": "pydantic 2.13.4's pin",
    "annotated-types==0.8.0": "pydantic",
    "typing-inspection==0.4.4": "pydantic, fastapi",
    "msgspec==0.23.0": "vllm.sampling_params, the V1 engine's request structs",
    "pyzmq==27.3.0": "vllm.utils.network_utils, vllm.v1.serial_utils (zmq)",
    "cbor2==6.3.0": "vllm.utils.hashing (prefix-cache block hashes)",
    "pybase64==1.5.1": "vllm.multimodal.media, reached from vllm.v1.core.sched.output",
    "cachetools==8.0.2": "vllm.utils.cache, reached from vllm.multimodal",
    "fastapi==0.136.3": "vllm.entrypoints.serve, reached from vllm.v1.request through the "
                        "tool parsers (vLLM pins <0.137)",
    "starlette==1.10.0": "fastapi; vLLM asks >=1.0.1",
    "openai==2.54.0": "vllm.entrypoints.openai protocol types, reached from vllm.config "
                      "(openai 3.x needs httpx2, which the image lacks)",
    "distro==1.9.0": "openai._base_client",
    "sniffio==1.3.1": "openai",
    "oss-harmony==0.0.11": "openai_harmony: vllm.reasoning / vllm.entrypoints.mcp, reached "
                           "from vllm.config",
    "partial-json-parser==0.2.1.1.post7": "vllm.tool_parsers.utils, reached from "
                                          "vllm.v1.structured_output",
    "xgrammar==0.2.7": "vllm.parser.harmony (module level), reached from "
                       "vllm.v1.structured_output",
    "apache-tvm-ffi==0.1.11": "xgrammar imports tvm_ffi; vLLM pins 0.1.11",
    "llguidance==1.7.6": "vllm.v1.structured_output imports backend_guidance, whose class "
                         "body annotation loads llguidance at import (a manylinux_2_31 wheel)",
    "trl==1.16.0": "the trainer",
    "datasets==5.2.0": "trl",
    "dill==0.4.1": "datasets",
    "multiprocess==0.70.19": "datasets",
    "compressed-tensors==0.17.0": "vLLM's quantization registry (get_quantization_config, "
                                  "run for every model on CUDA while the LLM is built) imports "
                                  "CompressedTensorsConfig: the first device run stopped there",
    "loguru==0.7.3": "compressed-tensors imports it; the image lacks it",
}

#: vLLM 0.31.0's other requirements: in the image (IN_IMAGE), or not imported on the
#: colocate path (why), so they stay here. ``audit`` fails when vLLM names one that
#: is in none of the three; ``check`` on the GPU machine lists the unmet ones.
NOT_CARRIED = {
    "flashinfer-python": "FlashAttention 3 attends on Hopper (the backend selector skips "
                         "backends whose import fails). The V2 model runner's sampler imports "
                         "the FlashInfer backend unless VLLM_USE_FLASHINFER_SAMPLER=0, which "
                         "environment() sets: top-p/top-k sample in PyTorch, on both sides",
    "tilelang": "imported only inside the kernels that use it (not Qwen2's)",
    "nvidia-cudnn-frontend": "cuDNN attention / FP8 paths only",
    "nvtx": "profiling ranges only (imported inside a function)",
    "fastsafetensors": "an optional weight loader, imported in a try block",
    "instanttensor": "an optional weight loader, imported inside a function",
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (FlashAttention 4, Blackwell), imported "
                          "inside functions",
    "quack-kernels": "CuTe-DSL kernels, imported inside functions",
    "tokenspeed-mla": "MLA attention (DeepSeek), not Qwen2",
    "humming-kernels": "quantized kernels, imported inside functions",
    "torchcodec": "audio/video decoding, imported in a try block",
    "pynvvideocodec": "video decoding",
    "mistral-common": "Mistral tokenizers, imported when a Mistral tokenizer is asked for",
    "lm-format-enforcer": "a structured-output backend, imported when a request asks for it",
    "outlines-core": "a structured-output backend, imported when a request asks for it",
    "lark": "a structured-output backend, imported when a request asks for it",
    "jsonschema": "structured outputs and tool calls only",
    "depyf": "torch.compile debug dumps and one error message, imported inside functions",
    "blake3": "multimodal input hashing, imported inside a function",
    "setproctitle": "process titles of vLLM's own processes, imported in a try block "
                    "(colocate runs in the trainer's process)",
    "orjson": "the OpenAI server",
    "prometheus-fastapi-instrumentator": "the OpenAI server",
    "watchfiles": "the server's reload mode",
    "python-json-logger": "JSON logging, configured only by VLLM_LOGGING_CONFIG_PATH",
    "ijson": "the server's streaming parsers",
    "anthropic": "the Anthropic-compatible server",
    "model-hosting-container-standards": "the server's SageMaker routes",
    "mcp": "the server's tool servers, imported inside functions",
    "opentelemetry-sdk": "tracing, imported in a try block",
    "opentelemetry-api": "tracing, imported in a try block",
    "opentelemetry-exporter-otlp": "tracing, imported in a try block",
    "opentelemetry-semantic-conventions-ai": "tracing, imported in a try block",
}

#: requirements the stack meets at another version than pinned, on purpose: ``check``
#: names them with the reason instead of failing (read from its CPU run, 2026-12-02:
#: every colocate module imported with these versions, but the two that need the CUDA
#: driver)
OTHER_VERSION_OK = {
    "nvidia-nccl-cu13": "NCCL 2.30.7 is preloaded in its place: several ranks on one GPU "
                        "need >= 2.30 (torch 2.13's 2.29.7 refuses them)",
    "cuda-toolkit": "torch runs on the image's CUDA 13 libraries (nvidia/*/lib, the same "
                    "major); the wheels of the pinned minor do not travel",
    "nvidia-cudnn-cu13": "the image's cuDNN; the compatibility check is skipped "
                         "(environment: PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK) and nothing on "
                         "the colocate path runs a cuDNN kernel",
    "nvidia-cusparselt-cu13": "the image's; sparse matmuls only, not on the colocate path",
    "numba": "vLLM imports numba for n-gram speculative decoding and inside a helper "
             "function only (v1/spec_decode/ngram_proposer.py, utils/jit_monitor.py)",
    "setuptools": "vLLM's upper bound guards its build; no colocate module imports it",
    "jiter": "openai imports it for streamed chat-completion parsing only "
             "(openai/lib/streaming), not reached from vLLM's protocol types",
}

#: vLLM's, torch's and trl's requirements the image already has (KINDS.md "Python
#: packages already there"; torchaudio at vLLM's own pin, 2.11.0); ``check`` there
#: compares their versions with the specifiers.
IN_IMAGE = (
    "regex", "psutil", "sentencepiece", "numpy", "requests", "certifi", "tqdm", "py-cpuinfo",
    "transformers", "huggingface-hub", "tokenizers", "safetensors", "protobuf", "aiohttp",
    "multidict", "prometheus-client", "pillow", "tiktoken", "typing-extensions", "filelock",
    "opencv-python-headless", "pyyaml", "six", "setuptools", "einops", "cloudpickle", "ninja",
    "torchaudio", "numba", "accelerate", "pyarrow", "pandas", "xxhash", "fsspec", "jinja2",
    "httpx", "anyio", "annotated-doc", "packaging", "sympy", "networkx", "cuda-bindings",
)

#: the modules a colocated ``vllm.LLM`` in trl 1.16's GRPOTrainer imports: ``check``
#: imports each (after the install) and says which one fails
COLOCATE_MODULES = (
    "torch", "triton", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.platforms.cuda",
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.qwen2", "vllm.model_executor.model_loader.default_loader",
    "vllm.v1.attention.backends.flash_attn", "vllm.device_allocator.cumem",
    "vllm.distributed.weight_transfer.nccl_common", "trl.generation.vllm_generation",
    "trl.trainer.grpo_trainer",
    # what building an LLM imports beyond the modules above (the first device run's stops)
    "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu.sample.sampler",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    # the package itself, installed by install(): the GPU scripts import the adapter
    "amem_callbacks.adapters.trl",
)


def canonical(name: str) -> str:
    """PEP 503 name: pip, importlib.metadata and the METADATA files may spell it apart."""
    out = name.lower().replace("_", "-").replace(".", "-")
    while "--" in out:
        out = out.replace("--", "-")
    return out


def carried(name: str) -> str:
    """The version of ``name`` that travels (CARRIED's pin)."""
    versions = {canonical(p.split("==")[0]): p.split("==")[1] for p in CARRIED}
    return versions[canonical(name)]


def pins() -> list:
    """``name==version`` of every carried wheel, in a fixed order."""
    return sorted(CARRIED, key=lambda pin: canonical(pin.split("==")[0]))


def requirement_names(metadata_text: str) -> list:
    """Names of the Requires-Dist lines of a METADATA text that hold without extras."""
    names = []
    for line in metadata_text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line[len("Requires-Dist:"):].partition(";")
        if "extra" in marker:
            continue
        name = spec.strip()
        for stop in " ([<>=!~;":
            name = name.split(stop)[0]
        names.append(canonical(name))
    return names


def audit(wheel: str) -> list:
    """The requirements of ``wheel`` (a vllm wheel) that are neither carried, nor in
    the image, nor named in NOT_CARRIED with a reason: a different vLLM build than
    the one these lists were read from. Empty when every requirement is accounted for."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read(next(n for n in z.namelist()
                           if n.endswith(".dist-info/METADATA"))).decode()
    known = ({canonical(p.split("==")[0]) for p in CARRIED} | {canonical(n) for n in IN_IMAGE}
             | {canonical(n) for n in NOT_CARRIED})
    return sorted(set(n for n in requirement_names(text) if n not in known))


# --- packing: fewer parts ------------------------------------------------------------
#: a packed wheel's suffix: the wheel re-written with stored (uncompressed) members, then xz
PACKED = ".whl.xz"


#: the packed form's version: a change to how pack() writes a file re-packs every file
PACK_FORMAT = 1
#: beside the packed files: each source file's sha256 and the format it was packed in
PACKED_FROM = "packed-from.json"


def pack(src: str, dest: str, xz_threads: int = 0) -> list:
    """Every wheel of ``src`` as ``dest/NAME.whl.xz``, other files copied as they are.
    A wheel's members are deflated one by one; re-written stored and compressed whole
    with xz they take about 30 % less (vLLM 0.31.0's 320.6 MB wheel: 221.6 MB), so the
    bundle needs fewer device calls. The members' bytes, names and modes do not change,
    so the wheel's RECORD still holds and pip installs the unpacked file as it is.
    A file packed before from the same bytes in the same format is kept (xz of the
    whole set takes about 15 minutes here; one added wheel, seconds), and packed files
    whose source is gone are removed. Returns (name, bytes before, bytes after) rows
    of the files packed now."""
    os.makedirs(dest, exist_ok=True)
    record_path = os.path.join(dest, PACKED_FROM)
    before = json.load(open(record_path)) if os.path.isfile(record_path) else {}
    record, rows = {}, []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            continue
        target = os.path.join(dest, name[:-4] + PACKED if name.endswith(".whl") else name)
        source = {"sha256": sha256_of(path), "format": PACK_FORMAT,
                  "packed": os.path.basename(target)}
        if before.get(name) == source and os.path.isfile(target):
            record[name] = source
            continue
        if not name.endswith(".whl"):
            shutil.copyfile(path, target)
        else:
            _pack_wheel(path, target, dest, xz_threads)
            rows.append((name, os.path.getsize(path), os.path.getsize(target)))
        record[name] = source
    kept = {r["packed"] for r in record.values()} | {PACKED_FROM}
    for name in os.listdir(dest):  # a wheel swapped for another version leaves no orphan
        if name not in kept and os.path.isfile(os.path.join(dest, name)):
            os.remove(os.path.join(dest, name))
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    return rows


def _pack_wheel(path: str, target: str, dest: str, xz_threads: int) -> None:
    with tempfile.NamedTemporaryFile(dir=dest, suffix=".zip", delete=False) as stored:
        with zipfile.ZipFile(path) as wheel, zipfile.ZipFile(stored, "w") as out:
            for info in wheel.infolist():
                member = zipfile.ZipInfo(info.filename, info.date_time)
                member.external_attr = info.external_attr
                out.writestr(member, wheel.read(info), zipfile.ZIP_STORED)
    try:
        _xz(stored.name, target, xz_threads)
    finally:
        os.remove(stored.name)


def _xz(src: str, target: str, threads: int) -> None:
    """xz with every core where the xz tool is here (minutes for torch's wheel), else
    the standard library's lzma (one core)."""
    xz = shutil.which("xz")
    if xz:
        with open(target, "wb") as out:
            subprocess.run([xz, f"-T{threads}", "-6", "-c", src], stdout=out, check=True)
        return
    with open(src, "rb") as f, lzma.open(target, "wb", preset=6) as out:
        shutil.copyfileobj(f, out, _BUF)


def unpack_wheel(path: str) -> str:
    """Device side: ``NAME.whl.xz`` -> ``NAME.whl`` beside it (stdlib lzma: the image may
    lack xz); the packed file is removed. Returns the wheel's path."""
    wheel = path[:-3]
    with lzma.open(path) as src, open(wheel, "wb") as out:
        shutil.copyfileobj(src, out, _BUF)
    os.remove(path)
    return wheel


# --- parts ---------------------------------------------------------------------------
def part_bytes_for(tree_bytes: int, limit: int = CALL_LIMIT, cap: int = PART_CAP,
                   margin: int = MARGIN) -> int:
    """The largest part one device call can carry beside a working tree of
    ``tree_bytes`` (what travels with every call); at most ``cap``."""
    room = limit - int(tree_bytes) - margin
    if room < _BUF:
        raise ValueError(f"the working tree that travels with every device call is "
                         f"{tree_bytes / 1e6:.1f} MB, which leaves no room under the "
                         f"{limit / 2**20:.0f} MiB a call carries: ignore or move large "
                         "files out of the tree first")
    return min(cap, room)


def tree_bytes(root: str = ROOT) -> int:
    """Bytes of what every device call sends: tracked and untracked-not-ignored files,
    and a shared/ folder inside the checkout."""
    try:
        listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True,
                                check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # an exported copy (git archive): no
        listed = [rel for folder, _dirs, files in os.walk(root)  # ignore rules: all counts
                  for rel in (os.path.relpath(os.path.join(folder, f), root) for f in files)
                  if rel.split(os.sep)[0] != "shared"]  # shared/ is counted below
    total = 0
    for rel in filter(None, listed):
        path = os.path.join(root, rel)
        if os.path.isfile(path) and not os.path.islink(path):
            total += os.path.getsize(path)
    shared = os.path.join(root, "shared")
    if os.path.isdir(shared):
        for folder, _dirs, files in os.walk(shared):
            total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BUF), b""):
            digest.update(block)
    return digest.hexdigest()


def part_name(index: int) -> str:
    return f"part-{index:02d}"


@dataclass(frozen=True)
class Layout:
    """Where each file sits in the stream of all files, cut into parts."""

    part_bytes: int
    files: tuple  # (name, size), in stream order

    @property
    def total(self) -> int:
        return sum(size for _name, size in self.files)

    @property
    def count(self) -> int:
        return max(1, -(-self.total // self.part_bytes))

    def parts_of(self, offset: int, size: int) -> list:
        """Indices of the parts holding bytes [offset, offset + size)."""
        if size == 0:
            return [offset // self.part_bytes]
        return list(range(offset // self.part_bytes, (offset + size - 1) // self.part_bytes + 1))

    def rows(self) -> list:
        out, offset = [], 0
        for name, size in self.files:
            out.append({"file": name, "size": size, "offset": offset,
                        "parts": self.parts_of(offset, size)})
            offset += size
        return out


def split(src: str, dest: str, part_bytes: int, notes: Optional[dict] = None) -> dict:
    """Cut every file of folder ``src`` into parts of ``part_bytes`` (the last one
    shorter): ``dest/part-NN/part-NN.bin``, one folder per part so one device call
    carries one folder, each with the manifest (files: size, sha256, offset, parts;
    parts: size, sha256). Returns the manifest (also ``dest/manifest.json``)."""
    if part_bytes <= 0:
        raise ValueError(f"part_bytes must be > 0, got {part_bytes}")
    names = sorted(n for n in os.listdir(src)
                   if os.path.isfile(os.path.join(src, n)) and n != PACKED_FROM)
    if not names:
        raise ValueError(f"{src} holds no files to split")
    layout = Layout(part_bytes, tuple((n, os.path.getsize(os.path.join(src, n))) for n in names))
    if os.path.isdir(dest):
        for old in os.listdir(dest):  # a previous bundle's parts would mix with these
            path = os.path.join(dest, old)
            if old.startswith("part-") and os.path.isdir(path):
                shutil.rmtree(path)
            elif old == MANIFEST:
                os.remove(path)
    os.makedirs(dest, exist_ok=True)
    rows = layout.rows()
    parts, index, written, out, part_digest = [], -1, part_bytes, None, None

    def close_part():
        if out is not None:
            out.close()
            parts.append({"part": part_name(index), "size": written,
                          "sha256": part_digest.hexdigest()})

    for row in rows:
        digest = hashlib.sha256()
        with open(os.path.join(src, row["file"]), "rb") as f:
            while True:
                if written == part_bytes:
                    close_part()
                    index += 1
                    folder = os.path.join(dest, part_name(index))
                    os.makedirs(folder, exist_ok=True)
                    out = open(os.path.join(folder, part_name(index) + ".bin"), "wb")
                    written, part_digest = 0, hashlib.sha256()
                block = f.read(min(_BUF, part_bytes - written))
                if not block:
                    break
                out.write(block)
                digest.update(block)
                part_digest.update(block)
                written += len(block)
        row["sha256"] = digest.hexdigest()
    close_part()
    manifest = {"format": FORMAT, "part_bytes": part_bytes, "total_bytes": layout.total,
                "parts": parts, "files": rows, **(notes or {})}
    manifest["bundle_id"] = bundle_id(manifest)
    text = json.dumps(manifest, indent=1)
    for folder in [dest] + [os.path.join(dest, p["part"]) for p in parts]:
        with open(os.path.join(folder, MANIFEST), "w") as f:
            f.write(text)
    return manifest


def bundle_id(manifest: dict) -> str:
    """What names one bundle: the hashes of its parts (two bundles' parts never mix)."""
    parts = "".join(p["sha256"] for p in manifest["parts"])
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


def load_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"no {MANIFEST} in {folder}: is it a part folder of "
                         "tests/gpu/bundle_vllm.sh?") from None
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"{path}: format {manifest.get('format')!r}, this script reads "
                         f"{FORMAT}: re-run tests/gpu/bundle_vllm.sh")
    return manifest


def present(store: str, manifest: dict) -> list:
    """Names of the manifest's parts in ``store`` with the right size (their hashes
    were checked when they arrived)."""
    out = []
    for part in manifest["parts"]:
        path = os.path.join(store, part["part"] + ".bin")
        if os.path.isfile(path) and os.path.getsize(path) == part["size"]:
            out.append(part["part"])
    return out


def receive(part_dir: str, store: str = STORE) -> tuple:
    """Device side: check one carried part folder and copy its part into ``store``.
    Returns (parts there, parts missing) for the bundle."""
    manifest = load_manifest(part_dir)
    name = os.path.basename(os.path.normpath(part_dir))
    row = next((p for p in manifest["parts"] if p["part"] == name), None)
    if row is None:
        raise SystemExit(f"{part_dir}: its manifest has no part {name!r}")
    source = os.path.join(part_dir, name + ".bin")
    if not os.path.isfile(source) or os.path.getsize(source) != row["size"] \
            or sha256_of(source) != row["sha256"]:
        raise SystemExit(f"{source}: missing or not the bytes the manifest names "
                         f"({row['size']} bytes, sha256 {row['sha256'][:12]}...): carry it again")
    os.makedirs(store, exist_ok=True)
    held = os.path.join(store, MANIFEST)
    if os.path.isfile(held):
        with open(held) as f:
            old = json.load(f)
        if old.get("bundle_id") != manifest["bundle_id"]:
            raise SystemExit(f"{store} holds parts of bundle {old.get('bundle_id')}, this part "
                             f"belongs to {manifest['bundle_id']}: rm -r {store} and send "
                             "every part of one bundle")
    else:
        shutil.copy(os.path.join(part_dir, MANIFEST), held)
    tmp = os.path.join(store, name + ".bin.tmp")
    shutil.copy(source, tmp)
    os.replace(tmp, os.path.join(store, name + ".bin"))
    have = present(store, manifest)
    missing = [p["part"] for p in manifest["parts"] if p["part"] not in have]
    return have, missing


def assemble(store: str, dest: str) -> list:
    """Device side: the bundle's files from the parts in ``store``, each checked
    against its sha256; returns their paths."""
    manifest = load_manifest(store)
    have = present(store, manifest)
    missing = [p["part"] for p in manifest["parts"] if p["part"] not in have]
    if missing:
        raise SystemExit(f"{len(missing)} of {len(manifest['parts'])} parts are not in {store} "
                         f"yet ({', '.join(missing)}): receive them first (the machine keeps "
                         "/tmp only while it stays warm)")
    os.makedirs(dest, exist_ok=True)
    size = manifest["part_bytes"]
    paths = []
    for row in manifest["files"]:
        path = os.path.join(dest, row["file"])
        digest, offset, left = hashlib.sha256(), row["offset"], row["size"]
        with open(path, "wb") as out:
            while left:
                index, within = divmod(offset, size)
                with open(os.path.join(store, part_name(index) + ".bin"), "rb") as f:
                    f.seek(within)
                    take = min(left, size - within)
                    while take:
                        block = f.read(min(_BUF, take))
                        if not block:
                            raise SystemExit(f"{part_name(index)} ends early: receive it again")
                        out.write(block)
                        digest.update(block)
                        take -= len(block)
                        left -= len(block)
                        offset += len(block)
        if digest.hexdigest() != row["sha256"]:
            raise SystemExit(f"{row['file']}: sha256 differs from the manifest after "
                             "re-assembly: receive its parts again")
        paths.append(path)
    return paths


def install(store: str = STORE, site: str = SITE, nccl_dir: str = NCCL_DIR,
            python: str = sys.executable, package: Optional[str] = ROOT) -> dict:
    """Device side: re-assemble the files, install every wheel into ``site``
    (``pip --no-index --no-deps --target``: the image's own packages stay as they
    are), unpack NCCL into ``nccl_dir`` and install ``package`` (this repository;
    None: not). Only the package when ``site`` already holds this bundle."""
    manifest = load_manifest(store)
    marker = os.path.join(site, ".amem-vllm-bundle")
    if os.path.isfile(marker):
        with open(marker) as f:
            if f.read().strip() == manifest["bundle_id"]:
                install_package(python, package)
                return {"installed": False, "why": "already installed", "site": site}
    files = assemble(store, os.path.join(store, "files"))
    files = [unpack_wheel(p) if p.endswith(PACKED) else p for p in files]
    wheels = [p for p in files if p.endswith(".whl")]
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", site, *wheels],
                   check=True)
    libraries = []
    for path in files:
        if path.endswith(".xz"):  # device-nccl's output: stdlib lzma, the image may lack xz
            os.makedirs(nccl_dir, exist_ok=True)
            target = os.path.join(nccl_dir, os.path.basename(path)[:-3])
            with lzma.open(path) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, _BUF)
            libraries.append(target)
    for path in files:  # the assembled copies: 1.2 GB the disk need not hold twice
        os.remove(path)
    install_package(python, package)
    with open(marker, "w") as f:
        f.write(manifest["bundle_id"])
    return {"installed": True, "site": site, "wheels": [os.path.basename(w) for w in wheels],
            "libraries": libraries}


def install_package(python: str = sys.executable, root: Optional[str] = ROOT) -> None:
    """The package itself, editable, into the image's Python: ``amem_callbacks.adapters``
    exists only as installed (pyproject maps adapters/ there), and the GPU scripts run
    on it. The first device run stopped at that import."""
    if root is None:
        return
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "-e", root], check=True)


#: what environment() sets, so what ``env`` prints for a shell to eval
ENV_KEYS = ("PYTHONPATH", "LD_PRELOAD", "NCCL_MULTI_RANK_GPU_ENABLE",
            "PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK", "VLLM_USE_FLASHINFER_SAMPLER")


def environment(base: Optional[dict] = None, site: str = SITE, nccl_dir: str = NCCL_DIR,
                root: str = ROOT) -> dict:
    """The environment a process runs the bundle in: ``site`` first on PYTHONPATH,
    so the carried torch, triton and torchvision win over the image's 2.11/3.6/0.26,
    then the repository; the image's site-packages stay on sys.path after them, and
    the carried torch finds the image's CUDA 13 libraries there (``nvidia/*/lib``).
    NCCL 2.30.7 is preloaded: several ranks on one GPU need >= 2.30 (torch 2.13's own
    2.29.7 refuses them). Everything else of ``base`` (default: os.environ) is kept, the
    image's NCCL_NVLS_ENABLE=0 included. Without the unpacked library (not installed
    yet) nothing is preloaded."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, root, env.get("PYTHONPATH")) if p)
    library = os.path.join(nccl_dir, "libnccl.so.2")
    if os.path.isfile(library) and library not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD")) if p)
    env.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    # torch 2.13 is built against cuDNN 9.20 and refuses an older minor at its first
    # cuDNN call; the image's cuDNN is torch 2.11's. Nothing on the colocate path runs
    # cuDNN kernels (no convolutions; vLLM attends with FlashAttention 3, the trainer
    # with eager attention): the check is what would fail, not a kernel.
    env.setdefault("PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK", "1")
    # flashinfer does not travel (NOT_CARRIED): without this vLLM 0.31's sampler imports
    # it while the engine is built and the start-up fails (measured, the first device run)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# --- what check() runs inside the bundle's environment --------------------------------
def unmet_requirements(dists: Iterable[str] = ("vllm", "trl", "datasets", "torch",
                                               "xgrammar", "compressed-tensors", "fastapi",
                                               "openai")) -> list:
    """Requirements of ``dists`` (extras left out) the installed packages do not meet:
    rows (dist, requirement, installed version or None, why it may stay unmet or None).
    Runs where the bundle is importable (``check`` starts it there)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    rows = []
    for dist in dists:
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            rows.append((dist, dist, None, _why_unmet(dist)))
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                have = None
            if have is not None and (not req.specifier or req.specifier.contains(
                    have, prereleases=True)):
                continue
            rows.append((dist, str(req), have, _why_unmet(req.name)))
    return rows


def _why_unmet(name: str) -> Optional[str]:
    """Why ``name`` may stay unmet (NOT_CARRIED, OTHER_VERSION_OK), or None."""
    for reasons in (NOT_CARRIED, OTHER_VERSION_OK):
        why = next((w for n, w in reasons.items() if canonical(n) == canonical(name)), None)
        if why:
            return why
    return None


_CHECK = r"""
import importlib, json, os, sys, time, ctypes
sys.path.insert(0, %(root)r)
from tests.gpu import vllm_bundle
out = {"python": sys.version.split()[0], "imports": {}, "versions": {}}
for name in %(modules)r:
    began = time.monotonic()
    try:
        module = importlib.import_module(name)
        out["imports"][name] = {"ok": True, "s": round(time.monotonic() - began, 2),
                                "file": getattr(module, "__file__", None)}
    except BaseException as exc:
        out["imports"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
from importlib import metadata
for dist in ("torch", "vllm", "triton", "torchvision", "torchaudio", "transformers",
             "accelerate", "trl", "datasets", "numpy", "pillow", "tokenizers", "peft"):
    try:
        out["versions"][dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        out["versions"][dist] = None
try:
    import torch
    out["cuda"] = torch.cuda.is_available()
    out["device"] = torch.cuda.get_device_name() if out["cuda"] else None
    out["cudnn"] = torch.backends.cudnn.version() if out["cuda"] else None
    lib = ctypes.CDLL("libnccl.so.2", os.RTLD_NOLOAD)
    v = ctypes.c_int()
    lib.ncclGetVersion(ctypes.byref(v))
    out["nccl_loaded"] = v.value
except BaseException as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"[:400]
out["unmet"] = vllm_bundle.unmet_requirements()
print(json.dumps(out))
"""


def check(site: str = SITE, python: str = sys.executable, timeout_s: float = 300,
          modules: Iterable[str] = COLOCATE_MODULES) -> dict:
    """Device side: import the colocate path's ``modules`` in the bundle's environment
    and report versions, the loaded NCCL and unmet requirements (JSON on stdout)."""
    script = _CHECK % {"root": ROOT, "modules": tuple(modules)}
    done = subprocess.run([python, "-c", script], env=environment(site=site),
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the check did not finish (rc {done.returncode}):\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1])
    # several ranks on one GPU need NCCL >= 2.30 (the preloaded 2.30.7, code 23007),
    # not the image's 2.28.9 that the carried torch would otherwise load from sys.path
    result["ok"] = (all(row["ok"] for row in result["imports"].values())
                    and not [r for r in result["unmet"] if r[3] is None]
                    and str(result["versions"].get("torch", "")).startswith(carried("torch"))
                    and (result.get("nccl_loaded") or 0) >= 23000)
    return result


def device_calls(dest: str, store: Optional[str] = None, site: Optional[str] = None,
                 check_after: bool = False) -> list:
    """The device calls that carry bundle ``dest``, in order: one part folder each (the
    machine keeps /tmp only while it stays warm between calls), the last chained with
    ``install`` (and ``check``). ``store``/``site``: another bundle's places there."""
    parts = [p["part"] for p in load_manifest(dest)["parts"]]
    where = f" --store {store}" if store else ""
    lines = []
    for i, part in enumerate(parts):
        line = f"python3 tests/gpu/vllm_bundle.py receive {dest}/{part}{where}"
        if i == len(parts) - 1:
            line += f" && python3 tests/gpu/vllm_bundle.py install{where}" + (
                f" --site {site}" if site else "")
            if check_after:
                line += " && python3 tests/gpu/vllm_bundle.py check"
        lines.append(f"carry [{dest}/{part}]: {line}")
    return lines


# --- the command line ------------------------------------------------------------------
def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pins", help="the carried wheels, name==version, one a line")
    p = sub.add_parser("version", help="the carried version of NAME")
    p.add_argument("name")
    p = sub.add_parser("audit", help="vLLM requirements of WHEEL that no list accounts for")
    p.add_argument("wheel")
    p = sub.add_parser("pack", help="SRC's wheels as DEST/NAME.whl.xz (stored, then xz), "
                                    "other files copied")
    p.add_argument("src")
    p.add_argument("dest")
    p = sub.add_parser("split", help="cut SRC's files into parts under DEST")
    p.add_argument("src")
    p.add_argument("dest")
    p.add_argument("--part-bytes", type=int, help="default: what a call carries beside the tree")
    p.add_argument("--pins", action=argparse.BooleanOptionalAction, default=True,
                   help="name vLLM's carried pins in the manifest (--no-pins: another bundle, "
                        "e.g. tests/gpu/bundle_torch.sh's)")
    p = sub.add_parser("commands", help="the device calls that carry bundle DEST, in order")
    p.add_argument("dest")
    p.add_argument("--store", default=None)
    p.add_argument("--site", default=None)
    p.add_argument("--check", action="store_true", help="chain `check` after `install`")
    p = sub.add_parser("receive", help="device: take one carried part folder")
    p.add_argument("part_dir")
    p.add_argument("--store", default=STORE)
    p = sub.add_parser("install", help="device: assemble the parts and install the wheels "
                                       "and this repository's package")
    p.add_argument("--store", default=STORE)
    p.add_argument("--site", default=SITE)
    p.add_argument("--no-package", action="store_true",
                   help="the wheels only, not this repository (editable) into this Python")
    p = sub.add_parser("check", help="device: import the colocate path in the bundle's env")
    p.add_argument("--site", default=SITE)
    p = sub.add_parser("env", help="export lines for a shell (eval \"$(... env)\")")
    p.add_argument("--site", default=SITE)
    args = parser.parse_args(argv)

    if args.command == "pins":
        print("\n".join(pins()))
    elif args.command == "version":
        print(carried(args.name))
    elif args.command == "audit":
        unknown = audit(args.wheel)
        if unknown:
            print(f"{args.wheel} requires what tests/gpu/vllm_bundle.py does not account for: "
                  f"{', '.join(unknown)}: read where vLLM imports each and add it to CARRIED "
                  "or NOT_CARRIED", file=sys.stderr)
            return 1
        print(f"every requirement of {os.path.basename(args.wheel)} is carried, in the image "
              "or not imported on the colocate path")
    elif args.command == "pack":
        for name, before, after in pack(args.src, args.dest):
            print(f"{before / 1e6:8.1f} MB -> {after / 1e6:7.1f} MB  {name}")
    elif args.command == "split":
        tree = tree_bytes()
        size = args.part_bytes or part_bytes_for(tree)
        notes = {"pins": pins()} if args.pins else {}
        manifest = split(args.src, args.dest, size, notes={**notes, "tree_bytes": tree})
        for row in manifest["files"]:
            print(f"{row['size'] / 1e6:9.1f} MB  {row['file']}  parts {row['parts']}")
        print(f"{len(manifest['parts'])} parts of at most {size / 1e6:.1f} MB "
              f"(the tree that travels with each call: {tree / 1e6:.1f} MB), "
              f"{manifest['total_bytes'] / 1e6:.1f} MB in all, bundle {manifest['bundle_id']}")
    elif args.command == "commands":
        print("\n".join(device_calls(args.dest, args.store, args.site, args.check)))
    elif args.command == "receive":
        have, missing = receive(args.part_dir, args.store)
        print(f"{len(have)} of {len(have) + len(missing)} parts in {args.store}"
              + (f"; still to send: {', '.join(missing)}" if missing else
                 "; all here: run `python3 tests/gpu/vllm_bundle.py install`"))
    elif args.command == "install":
        print(json.dumps(install(args.store, args.site,
                                 package=None if args.no_package else ROOT)))
    elif args.command == "check":
        result = check(args.site)
        print(json.dumps(result, indent=1))
        return 0 if result["ok"] else 1
    elif args.command == "env":
        env = environment(site=args.site)
        for key in ENV_KEYS:
            if env.get(key):
                print(f"export {key}={shlex.quote(env[key])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
