"""How many requests the engine runs at once, following its block count as Megatron
derives it at construction, and everything sized from that number (megatron-core
0.19.2; why each piece: docs/megatron.md, "Concurrency follows capacity").

``DynamicInferenceContext.__init__`` sets ``max_requests = total_count - 1``, rounded
down to the tensor-parallel size and ``REQUEST_ROUNDER``, unless the inference config
gives one, and builds the CUDA-graph batch list from it; the controller sizes its
sampling buffers from it once. Recompute mode re-runs ``initialize_all_tensors()`` (the
request tensors, the GPU view) and recaptures the graphs at every resume, so a new
count set while the engine is suspended is in force from that resume on.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from typing import Optional

from amem_callbacks.availability import is_distributed_initialized, loaded_torch

BUILDER_MODULE = "megatron.core.inference.batch_dimensions_utils"
BUILDER = "CUDAGraphBatchDimensionBuilder"


def why_fixed(engine) -> Optional[str]:
    """None when ``max_requests`` may follow the block count, else why it stays."""
    context = engine.context
    config = getattr(context, "config", None)
    given = getattr(config, "max_requests", None)
    if given is not None:
        return (f"max_requests {given} is set (--inference-dynamic-batching-max-requests): "
                "kept as given")
    if ep_size(engine) > 1:
        return ("expert parallelism: CUDA-graph batch sizes are matched across the expert-"
                "parallel group, which spans replicas: max_requests kept")
    if getattr(context, "is_hybrid_model", False):
        return ("a hybrid (Mamba) model sizes its per-request states from a memory split made "
                "at launch: max_requests kept")
    if not hasattr(getattr(engine, "controller", None), "_init_dynamic_sampling_tensors"):
        return "this megatron-core's controller cannot re-size its sampling buffers"
    found = builder(context)
    if found is None:
        return f"this megatron-core has no {BUILDER}: the CUDA-graph list cannot be re-built"
    takes = inspect.signature(found.generate_cuda_graph_batch_dimensions_list).parameters
    if not set(_graph_list_arguments(context, 1, 1)) <= set(takes):
        return (f"this megatron-core's {BUILDER} takes other arguments than 0.19's: the "
                "CUDA-graph list cannot be re-built")
    return None


def builder(context):
    """The CUDA-graph batch-list builder the context's own module uses."""
    module = sys.modules.get(type(context).__module__)
    found = getattr(module, BUILDER, None)
    if found is None:
        try:
            found = getattr(importlib.import_module(BUILDER_MODULE), BUILDER, None)
        except ImportError:
            return None
    return found


def _group_size(engine, role: str) -> int:
    """The size of the engine's ``role`` group (1 without one or without torch.distributed)."""
    group = getattr(getattr(engine, "pg_collection", None), role, None)
    if group is None or not is_distributed_initialized():
        return 1
    return loaded_torch().distributed.get_world_size(group)


def ep_size(engine) -> int:
    return _group_size(engine, "ep")


def tp_size(engine) -> int:
    return _group_size(engine, "tp")


def requests_for(context, blocks: int, tp: int) -> int:
    """Megatron's default ``max_requests`` for ``blocks`` blocks (one block a request,
    less the dummy block), within ``max_tokens``. Rounded to a multiple of both the TP
    size and ``REQUEST_ROUNDER``, which is what Megatron's two roundings give for the
    TP sizes it accepts."""
    rounder = getattr(type(context), "REQUEST_ROUNDER", 1)
    step = tp * rounder // math.gcd(tp, rounder)
    count = min(blocks - 1, getattr(context, "max_tokens", blocks - 1) or blocks - 1)
    return max(step, count // step * step)


def bytes_per_request(engine) -> int:
    """Device bytes one more concurrent request costs beyond its KV blocks: its rows of
    logits (the controller's buffer, the forward's output, float32 log-probs) and its
    bookkeeping (request fields and block table in the context's GPU view). A step's
    other activations are bounded by ``max_tokens``, which does not change."""
    context, controller = engine.context, getattr(engine, "controller", None)
    rows = getattr(context, "num_speculative_tokens", 0) + 1
    vocab = getattr(controller, "vocab_size", 0) or 0
    dtype = getattr(getattr(getattr(controller, "inference_wrapped_model", None), "config",
                            None), "params_dtype", None)
    itemsize = getattr(dtype, "itemsize", 2)
    bookkeeping = 4 * (getattr(context, "max_kv_block_count", 0) + 32)
    return rows * vocab * (2 * itemsize + 4) + bookkeeping


def resize(engine, max_requests: int, tp: int) -> None:
    """Set ``max_requests`` and re-size what was sized from it at construction, while
    the engine is suspended (its resume re-allocates the request tensors and captures
    the graphs from the new list). Call only when :func:`why_fixed` is None."""
    context = engine.context
    if context.max_requests == max_requests:
        return
    context.max_requests = max_requests
    set_attention_metadata(context, "max_bs", max_requests)
    _rebuild_graph_list(context, max_requests, tp)
    controller = engine.controller
    # The method also clears the stop-word callback the engine set at construction.
    callback = getattr(controller, "_get_stop_word_finished_ids_callback", None)
    controller._init_dynamic_sampling_tensors()
    controller._get_stop_word_finished_ids_callback = callback


def set_attention_metadata(context, name: str, value: int) -> None:
    """Set ``name`` on the context's attention metadata, graphed and not: it keeps
    its own copy of the batch and block limits it was built with."""
    for metadata in (getattr(context, "graph_attn_metadata", None),
                     getattr(context, "non_graph_attn_metadata", None)):
        mha = metadata.get("mha_metadata") if isinstance(metadata, dict) else None
        if mha is not None and hasattr(mha, name):
            setattr(mha, name, value)


def _rebuild_graph_list(context, max_requests: int, tp: int) -> None:
    """The CUDA-graph batch list as the context's constructor builds it, for the new count."""
    built = builder(context).generate_cuda_graph_batch_dimensions_list(
        **_graph_list_arguments(context, max_requests, tp))
    context.cuda_graph_batch_dimensions_list, context.cuda_graph_token_counts = built


def _graph_list_arguments(context, max_requests: int, tp: int) -> dict:
    """What 0.19's constructor passes the builder, for ``max_requests`` requests."""
    config = context.config
    speculative = getattr(context, "num_speculative_tokens", 0)
    decode_bound = max_requests * (speculative + 1)
    graph_tokens = (context.max_tokens if getattr(config, "cuda_graph_all_prefills", False)
                    else min(max(config.cuda_graph_max_tokens, decode_bound), context.max_tokens))
    return dict(
        tp_size=tp, num_cuda_graphs=config.num_cuda_graphs, cuda_graph_max_tokens=graph_tokens,
        cuda_graph_mixed_prefill_request_count=config.cuda_graph_mixed_prefill_count,
        max_requests=max_requests, max_tokens=context.max_tokens,
        max_sequence_length=context.max_sequence_length,
        use_cuda_graphs_for_non_decode_steps=context.use_cuda_graphs_for_non_decode_steps,
        num_speculative_tokens=speculative,
        sizing_distribution=getattr(config, "cuda_graph_sizing_distribution", None))
