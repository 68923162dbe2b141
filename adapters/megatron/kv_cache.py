"""The KV cache's size in ``recompute`` mode: what it is at launch, what the freed bytes
make of it (blocks, and the requests those blocks can run at once), the same on every
rank of one model replica (how and why: docs/megatron.md, "Growing the KV cache")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from amem_callbacks.availability import is_cuda_initialized, loaded_torch

from . import concurrency

GROWABLE_MODE = "recompute"


@dataclass(frozen=True)
class Size:
    """A KV cache: blocks in the pool, requests run at once."""

    blocks: int
    max_requests: int


@dataclass(frozen=True)
class Launch:
    """The engine as launched, and what one more block and one more request cost."""

    size: Size
    block_bytes: int
    block_tokens: int
    request_bytes: int  # beyond its blocks (concurrency.bytes_per_request)
    tp: int
    fixed: Optional[str]  # why max_requests does not follow the blocks, else None

    @classmethod
    def of(cls, engine) -> "Launch":
        context = engine.context
        return cls(Size(context.kv_block_allocator.total_count, context.max_requests),
                   context.block_size_bytes, getattr(context, "block_size_tokens", 0),
                   concurrency.bytes_per_request(engine), concurrency.tp_size(engine),
                   concurrency.why_fixed(engine))

    def grown_by(self, context, extra_bytes: int) -> Size:
        """The biggest cache ``extra_bytes`` more than the launch's can hold: every
        block may bring one more request, so each costs a block and a request."""
        if self.fixed is not None:
            return Size(self.size.blocks + extra_bytes // self.block_bytes,
                        self.size.max_requests)
        blocks = self.size.blocks + extra_bytes // (self.block_bytes + self.request_bytes)
        requests = max(self.size.max_requests, concurrency.requests_for(context, blocks, self.tp))
        return Size(blocks, requests)

    def bytes_of(self, size: Size) -> int:
        """Device bytes a cache of ``size`` takes (its blocks and extra request rows)."""
        return (size.blocks * self.block_bytes
                + max(0, size.max_requests - self.size.max_requests) * self.request_bytes)


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
    launch_max_requests: int = 0
    freed_bytes: int = 0  # what this rank's begin freed so far (NCCL's account)
    margin_bytes: int = 0
    agreed_extra_bytes: int = 0  # the minimum over the model replica's ranks, less the margin
    when: str = ""  # "resume", or "step N" of the rollout
    after_s: float = 0.0  # from the rollout's start
    regrow_s: float = 0.0  # the engine's suspend, resize and resume mid-rollout
    fixed_why: str = ""  # why max_requests did not follow, if it did not

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
        figures = dict(bytes=self.kv_bytes, blocks=self.blocks, launch_blocks=self.base_blocks,
                       token_capacity=self.token_capacity, max_requests=self.max_requests,
                       launch_max_requests=self.launch_max_requests,
                       from_freed_bytes=self.from_freed_bytes, margin_bytes=self.margin_bytes,
                       grown=int(self.grown), grown_after_s=self.after_s,
                       regrow_s=self.regrow_s)
        return {f"{prefix}kv_cache/{name}": value for name, value in figures.items()}

    def summary(self) -> str:
        line = (f"KV cache {self.kv_bytes / 2**30:.2f} GiB = {self.blocks} blocks "
                f"({self.token_capacity} tokens), {self.max_requests} requests at once "
                f"(launch: {self.base_blocks} blocks, {self.launch_max_requests} requests)")
        if self.fixed_why:
            line += f" [{self.fixed_why}]"
        if self.grown:
            return (line + f", {self.from_freed_bytes / 2**30:.2f} GiB of it from freed NCCL "
                    f"memory ({self.freed_bytes / 2**30:.2f} GiB freed here, "
                    f"{self.margin_bytes / 2**30:.2f} GiB margin), grown at {self.when} "
                    f"{self.after_s:.2f} s into the rollout in {self.regrow_s:.2f} s")
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
    concurrency.set_attention_metadata(context, "max_blocks", total_count)


def apply(engine, launch: Launch, size: Size) -> None:
    """Install ``size`` while the engine is suspended: its resume allocates the cache
    and the request tensors for it and captures the graphs."""
    context = engine.context
    if context.kv_block_allocator.total_count != size.blocks:
        _replace_allocator(context, size.blocks)
    if launch.fixed is None:
        concurrency.resize(engine, size.max_requests, launch.tp)


def has_room(launch: Launch, size: Size, held_bytes: int) -> bool:
    """Whether this GPU can take a cache of ``size`` once the ``held_bytes`` of the
    current one are given back: free device memory and what torch's allocator caches
    unused. True where CUDA cannot tell (no GPU: nothing to run out of)."""
    if not is_cuda_initialized():
        return True
    torch = loaded_torch()
    free, _total = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return free + cached + held_bytes >= launch.bytes_of(size)
