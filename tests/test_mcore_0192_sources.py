"""megatron-core 0.19.2, the release users run, checked on CPU from its wheel:
the KV-cache growth against its own block allocator, and every name the
collective-path audit relies on.

megatron-core 0.19.2 needs Python >= 3.12 and a GPU stack to import whole, so
CI (Python 3.11, megatron-core 0.16.1) cannot install it. Its block allocator
is CPU bookkeeping, though: this test downloads the 0.19.2 wheel from PyPI
(2.4 MB), loads ``kv_block_allocator.py`` from it with the real enums of its
``config.py``, and runs the adapter's allocator replacement on it. It also
reads, from the same sources, the two facts the growth relies on: recompute
mode re-allocates from ``kv_block_allocator.total_count``, and the attention
metadata keeps the block count as ``max_blocks``.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import types
import zipfile

import pytest

from tests.requires import skip_for_download

# its sources, compiled here, have an invalid escape in a docstring
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

VERSION = "0.19.2"
INFERENCE = "megatron/core/inference"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("mcore")
    run = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", f"megatron-core=={VERSION}", "--no-deps",
         "--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
         "-d", str(out)], capture_output=True, text=True, timeout=180)
    found = sorted(out.glob("megatron_core-*.whl"))
    if run.returncode != 0 or not found:
        # pip's last line says why (no index reachable, no such version), in one line
        why = (run.stderr.strip().splitlines() or ["no wheel came down"])[-1]
        skip_for_download(f"could not download megatron-core {VERSION} from the package index: "
                          f"{why}")
    return zipfile.ZipFile(found[0])


def _source(wheel, path: str) -> str:
    return wheel.read(path).decode()


@pytest.fixture(scope="module")
def mcore(wheel, monkeypatch_module):
    """``(kv_block_allocator module, config enums)`` from the 0.19.2 wheel."""
    config_src = _source(wheel, f"{INFERENCE}/config.py")
    enums = [node for node in ast.parse(config_src).body if isinstance(node, ast.ClassDef)
             and any(getattr(base, "id", None) == "Enum" for base in node.bases)]
    config = types.ModuleType("megatron.core.inference.config")
    exec("from enum import Enum\n" + "\n".join(ast.get_source_segment(config_src, node)
                                               for node in enums), config.__dict__)
    # only for loading the one file: the installed megatron (if any) is put back after
    for parent in ("megatron", "megatron.core", "megatron.core.inference"):
        try:
            importlib.import_module(parent)
        except Exception:  # no (importable) megatron here: empty packages will do
            monkeypatch_module.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch_module.setitem(sys.modules, "megatron.core.inference.config", config)
    path = wheel.extract(f"{INFERENCE}/contexts/kv_block_allocator.py",
                         path=str(wheel.filename) + ".src")
    spec = importlib.util.spec_from_file_location("mcore_0192_kv_block_allocator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, config


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.parametrize("prefix_caching,policy", [(False, "REF_ZERO"), (True, "LRU")])
def test_the_replacement_is_the_real_allocator_with_more_blocks(mcore, prefix_caching, policy):
    from amem_callbacks.adapters.megatron.kv_cache import _replace_allocator

    kvba, config = mcore
    policy = getattr(config.PrefixCachingEvictionPolicy, policy)
    context = types.SimpleNamespace(
        graph_attn_metadata={"mha_metadata": types.SimpleNamespace(max_blocks=100)},
        non_graph_attn_metadata={"mha_metadata": types.SimpleNamespace(max_blocks=100)})
    context.kv_block_allocator = kvba.KVBlockAllocator(
        context, total_count=100, paused_count=10, enable_prefix_caching=prefix_caching,
        prefix_caching_eviction_policy=policy)
    hook = context.kv_block_allocator.on_blocks_deregistered = lambda block_ids: None

    _replace_allocator(context, 160)

    new = context.kv_block_allocator
    assert type(new) is kvba.KVBlockAllocator and new.context is context
    assert (new.total_count, new.paused_count, new.active_count) == (160, 10, 149)
    assert new.total_avail == 159 and new.dummy_block_idx == 159 and len(new.block_bag) == 160
    assert new.enable_prefix_caching is prefix_caching
    assert new.prefix_caching_eviction_policy is policy
    assert new.on_blocks_deregistered is hook
    assert all(m["mha_metadata"].max_blocks == 160
               for m in (context.graph_attn_metadata, context.non_graph_attn_metadata))
    if prefix_caching:
        assert len(new.block_hashes) == len(new.block_ref_counts) == 160
        assert len(new.block_parent_id) == len(new.block_child_count) == 160


def test_the_growth_reads_the_modes_0192_names(mcore):
    from amem_callbacks.adapters.megatron.kv_cache import GROWABLE_MODE, why_not_growable

    _, config = mcore
    assert config.KVCacheManagementMode.RECOMPUTE.value == GROWABLE_MODE
    context = types.SimpleNamespace(kv_block_allocator=object(), static_kv_memory_pointers=False,
                                    unified_memory_level=0, _uses_torch_memory_saver=False,
                                    kv_cache_management_mode=config.KVCacheManagementMode.RECOMPUTE)
    assert why_not_growable(context) is None
    for mode in ("PERSIST", "OFFLOAD"):
        context.kv_cache_management_mode = getattr(config.KVCacheManagementMode, mode)
        assert "never re-allocated" in why_not_growable(context)


def test_recompute_mode_reallocates_from_the_allocators_block_count(wheel):
    """What a bigger allocator relies on, read from 0.19.2's sources."""
    context = ast.parse(_source(wheel, f"{INFERENCE}/contexts/dynamic_context.py"))
    methods = {node.name: node for node in ast.walk(context) if isinstance(node, ast.FunctionDef)}
    reinit = ast.unparse(methods["reinitialize_inference_state_buffers"])
    assert "KVCacheManagementMode.RECOMPUTE" in reinit and "self.initialize_all_tensors()" in reinit
    allocate = ast.unparse(methods["_allocate_memory_buffer"])
    assert "self.kv_block_allocator.total_count" in allocate
    metadata = _source(wheel, f"{INFERENCE}/contexts/attention_context/mha_metadata.py")
    assert "self.max_blocks = block_count_total" in metadata


def _defines(tree, name: str) -> bool:
    """``name`` is bound at the top level of ``tree`` (def, class, assignment or
    import, also inside a top-level try/if)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name) == name for alias in node.names):
                return True
    return False


def _class_defines(tree, class_name: str, member: str) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return _defines(ast.Module(body=node.body, type_ignores=[]), member)
    return False


def test_every_megatron_core_name_the_audit_relies_on_is_in_0192(wheel):
    """The rows test_collective_paths checks on the installed megatron-core (0.16.1
    in CI), read from the sources of the release users run."""
    from tests.test_collective_paths import MEGATRON_CORE, MEGATRON_CORE_GROWTH

    missing = []
    for module, path, why in MEGATRON_CORE + MEGATRON_CORE_GROWTH:
        try:
            tree = ast.parse(_source(wheel, module.replace(".", "/") + ".py"))
        except KeyError:
            missing.append(f"{module} ({why}): no such file in {VERSION}")
            continue
        first, _, member = path.partition(".")
        found = _class_defines(tree, first, member.split(".")[0]) if member \
            else _defines(tree, first)
        if not found:
            missing.append(f"{module}.{path} ({why})")
    assert not missing, f"gone from megatron-core {VERSION}:\n" + "\n".join(missing)
