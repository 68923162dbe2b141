"""The freed bytes become KV cache in ``recompute`` mode, the same size on every rank of one
model replica (how and why: docs/megatron.md, "Growing the KV cache")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from amem_callbacks.log import logger

GROWABLE_MODE = "recompute"


@dataclass
class KvCacheReport:
    """What one rollout's KV cache is, and how much of it came from freed memory."""

    grown: bool
    why: str
    blocks: int = 0
    base_blocks: int = 0
    block_bytes: int = 0
    block_tokens: int = 0
    max_requests: int = 0
    freed_bytes: int = 0  # what this rank's begin freed (NCCL's account)
    margin_bytes: int = 0
    agreed_extra_bytes: int = 0  # the minimum over the model replica's ranks

    @property
    def kv_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def token_capacity(self) -> int:
        return max(0, self.blocks - 1) * self.block_tokens  # one dummy block

    @property
    def from_freed_bytes(self) -> int:
        return max(0, self.blocks - self.base_blocks) * self.block_bytes

    def as_dict(self, prefix: str = "amem/") -> dict:
        figures = dict(bytes=self.kv_bytes, blocks=self.blocks, token_capacity=self.token_capacity,
                       max_requests=self.max_requests, from_freed_bytes=self.from_freed_bytes,
                       margin_bytes=self.margin_bytes, grown=int(self.grown))
        return {f"{prefix}kv_cache/{name}": value for name, value in figures.items()}

    def summary(self) -> str:
        line = (f"KV cache {self.kv_bytes / 2**30:.2f} GiB = {self.blocks} blocks "
                f"({self.token_capacity} tokens, max_requests {self.max_requests})")
        if self.grown:
            return (line + f", {self.from_freed_bytes / 2**30:.2f} GiB of it from freed NCCL "
                    f"memory ({self.freed_bytes / 2**30:.2f} GiB freed here, "
                    f"{self.margin_bytes / 2**30:.2f} GiB margin)")
        return line + f"; not grown: {self.why}"


def why_not_growable(context) -> Optional[str]:
    """None when this context re-allocates its cache at every resume, else why not."""
    if not hasattr(context, "kv_block_allocator"):
        return ("this megatron-core has no KVBlockAllocator (0.17+ needed): the KV cache "
                "cannot grow")
    mode = getattr(getattr(context, "kv_cache_management_mode", None), "value", None)
    if mode != GROWABLE_MODE:
        return (f"--rl-kv-cache-management-mode is {mode or 'persist'}: the engine keeps its KV "
                "cache at one size and address for the whole run (captured CUDA graphs point at "
                "it), so it is never re-allocated; use --rl-kv-cache-management-mode recompute")
    if getattr(context, "static_kv_memory_pointers", False):
        return "--rl-persist-cuda-graphs keeps the KV cache's address fixed: it cannot grow"
    if getattr(context, "unified_memory_level", 0):
        return "unified memory (--inference-dynamic-batching-unified-memory-level) keeps its pool"
    if getattr(context, "_uses_torch_memory_saver", False):
        return "torch_memory_saver keeps the KV cache's address fixed: it cannot grow"
    return None


class KvCacheGrowth:
    """Gives each rollout's KV cache the bytes that rollout's begin freed, less
    ``margin_bytes``. ``exchange(name, value, ranks) -> ({rank: value}, missing)``:
    the policy's store exchange (bounded, never NCCL)."""

    def __init__(self, margin_bytes: int, exchange):
        self.margin_bytes = margin_bytes
        self._exchange = exchange
        self._base: dict = {}  # id(context) -> blocks at launch
        self._warned = False

    def before_resume(self, engine, freed_bytes: int) -> KvCacheReport:
        """Collective over the engine's ``mp`` ranks (store): size the next allocation."""
        context = engine.context
        why = why_not_growable(context)
        if why is not None:
            if not self._warned:
                self._warned = True
                logger.warning("amem_callbacks: --rl-amem-grow-kv-cache does nothing here: %s", why)
            return self._report(context, False, why, freed_bytes)
        base = self._base.setdefault(id(context), context.kv_block_allocator.total_count)
        extra = max(0, freed_bytes - self.margin_bytes)
        agreed = self._agree(engine, extra)
        blocks = base + agreed // context.block_size_bytes
        if blocks != context.kv_block_allocator.total_count:
            _replace_allocator(context, blocks)
        why = "" if blocks > base else "the freed memory is less than the margin"
        report = self._report(context, blocks > base, why, freed_bytes, base)
        report.agreed_extra_bytes = agreed
        return report

    def _agree(self, engine, extra: int) -> int:
        import torch.distributed as dist

        mp = getattr(getattr(engine, "pg_collection", None), "mp", None)
        ranks = dist.get_process_group_ranks(mp) if mp is not None else [dist.get_rank()]
        # One name per model replica; the store agreement numbers the rounds.
        values, missing = self._exchange(f"kv_cache/{min(ranks)}", str(extra), ranks)
        if missing:  # a peer is late or gone: grow nothing rather than diverge
            logger.warning("amem_callbacks: rank(s) %s of this model replica did not report "
                           "their freed memory; the KV cache keeps its launch size", missing)
            return 0
        return min(int(v) for v in values.values())

    def _report(self, context, grown: bool, why: str, freed: int, base: int = 0) -> KvCacheReport:
        allocator = getattr(context, "kv_block_allocator", None)
        blocks = getattr(allocator, "total_count", 0)
        return KvCacheReport(
            grown=grown, why=why, blocks=blocks, base_blocks=base or blocks,
            block_bytes=getattr(context, "block_size_bytes", 0),
            block_tokens=getattr(context, "block_size_tokens", 0),
            max_requests=getattr(context, "max_requests", 0), freed_bytes=freed,
            margin_bytes=self.margin_bytes)


def _replace_allocator(context, total_count: int) -> None:
    """A new block pool of ``total_count`` blocks, like the old one in every other way;
    the engine's resume allocates the cache for it and resets it."""
    old = context.kv_block_allocator
    kwargs = {"context": context, "total_count": total_count, "paused_count": old.paused_count}
    for name in ("enable_prefix_caching", "prefix_caching_eviction_policy"):
        if hasattr(old, name):
            kwargs[name] = getattr(old, name)
    new = type(old)(**kwargs)
    if getattr(old, "on_blocks_deregistered", None) is not None:
        new.on_blocks_deregistered = old.on_blocks_deregistered
    context.kv_block_allocator = new
    for metadata in (getattr(context, "graph_attn_metadata", None),
                     getattr(context, "non_graph_attn_metadata", None)):
        mha = metadata.get("mha_metadata") if isinstance(metadata, dict) else None
        if mha is not None and hasattr(mha, "max_blocks"):
            mha.max_blocks = total_count
