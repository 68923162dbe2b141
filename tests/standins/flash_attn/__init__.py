"""TEST STAND-IN (never shipped): a pure-PyTorch stand-in for the two flash-attn 2
entry points that Megatron's dynamic inference engine calls
(megatron/core/transformer/attention.py: flash_decode_and_prefill). Paged KV
cache: k/v [num_blocks, block_size, H_kv, D], block_table [batch, max_blocks].

Batched over requests: the paged blocks of every request are gathered in one
indexing op (only up to the longest context where the caller gives it) and
attended in one masked ``scaled_dot_product_attention``, grouped-query heads
folded instead of K and V repeated, so a step costs about the same whatever the
number of requests, as with the real kernels. (A per-request Python loop made a step cost grow with the batch, and
a bigger KV cache, more requests at once, would then buy no throughput: the
rollout-gain measurement needs the batched form.) Not a fast kernel: for
functional tests and relative measurements only; flash-attn has no wheel for
the GPU machine, and Megatron's dynamic engine has no other attention path.
Results that used it say so. No CUDA graphs (keep --inference-cuda-graph-scope
none)."""
import torch
import torch.nn.functional as F

__version__ = "2.8.3"  # attention.py:1330 asserts is_fa_min_version("2.7.3")


def _paged(cache, block_table, max_k=None):
    """[B, blocks*block_size, H, D]: every request's blocks in order. ``max_k``
    (the longest context, where the caller knows it without a device sync):
    only the blocks that hold it are gathered, and the keys are cut there."""
    batch, blocks = block_table.shape
    if max_k is not None:
        blocks = min(blocks, max(1, -(-max_k // cache.shape[1])))
        block_table = block_table[:, :blocks]
    gathered = cache[block_table.long().clamp(min=0)]  # [B, blocks, bs, H, D]
    keys = gathered.reshape(batch, blocks * cache.shape[1], cache.shape[2], cache.shape[3])
    return keys if max_k is None else keys[:, :max_k]


def _mask(q_lens, k_lens, max_q, max_k, causal, window_size, device):
    """[B, 1, max_q, max_k]: keys a query may see; flash-attn aligns the causal
    mask bottom-right (query i of n sits at key position k_len - n + i)."""
    i = torch.arange(max_q, device=device)[None, :, None]
    j = torch.arange(max_k, device=device)[None, None, :]
    pos = (k_lens - q_lens)[:, None, None] + i
    mask = (j < k_lens[:, None, None]) & (i < q_lens[:, None, None])
    if causal:
        mask &= j <= pos
    if window_size is not None and window_size[0] >= 0:
        mask &= j >= pos - window_size[0]
    return mask[:, None]


def _attend(q, k, v, mask, scale):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hk, D] -> [B, Lq, Hq, D].

    Grouped-query attention without copying K and V per query head: the G query
    heads of each KV head are folded into the query length (query head h reads
    KV head h // G, flash-attn's convention), so the step reads each KV byte in
    use once, as the real kernel does; repeating K and V G times made a step's
    cost grow with the KV in use several times over."""
    batch, lq, hq, d = q.shape
    hk = k.shape[2]
    groups = hq // hk
    folded = q.reshape(batch, lq, hk, groups, d).permute(0, 2, 3, 1, 4).reshape(
        batch, hk, groups * lq, d)
    # A fully masked row (a padded query) gives NaN in SDPA: let it see key 0, drop it after.
    safe = mask.clone()
    safe[..., 0] |= ~mask.any(-1)
    safe = safe.repeat(1, 1, groups, 1)  # row g * Lq + i is query row i's mask
    out = F.scaled_dot_product_attention(folded, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=safe, scale=scale)
    return out.reshape(batch, hk, groups, lq, d).permute(0, 3, 1, 2, 4).reshape(
        batch, lq, hq, d)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), block_table=None, return_attn_probs=False,
                           **_):
    if return_attn_probs:
        raise NotImplementedError("flash_attn shim: no LSE (attention sinks unsupported)")
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    k_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    max_q = int(max_seqlen_q) if max_seqlen_q is not None else int(q_lens.max())
    max_k = int(max_seqlen_k) if max_seqlen_k is not None else None  # given: no device sync
    if block_table is not None:
        ks, vs = _paged(k, block_table, max_k), _paged(v, block_table, max_k)
    else:  # packed keys: pad each request's run the same way as the queries
        ks, vs = _pad(k, cu_seqlens_k, k_lens, int(k_lens.max())), _pad(
            v, cu_seqlens_k, k_lens, int(k_lens.max()))
    rows = cu_seqlens_q[:-1, None] + torch.arange(max_q, device=q.device)[None]
    valid = torch.arange(max_q, device=q.device)[None] < q_lens[:, None]
    q_pad = q[rows.clamp(max=q.shape[0] - 1)]  # [B, max_q, H, D]
    mask = _mask(q_lens, k_lens, max_q, ks.shape[1], causal, window_size, q.device)
    out_pad = _attend(q_pad, ks, vs, mask, softmax_scale)
    out = torch.empty_like(q)
    out[rows[valid]] = out_pad[valid].to(q.dtype)
    return out


def _pad(x, cu, lens, width):
    rows = cu[:-1, None] + torch.arange(width, device=x.device)[None]
    return x[rows.clamp(max=x.shape[0] - 1)]


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), num_splits=0, return_softmax_lse=False,
                            **_):
    if k is not None or v is not None or return_softmax_lse:
        raise NotImplementedError("flash_attn shim: only the paged read path is implemented")
    batch, max_q = q.shape[0], q.shape[1]  # q [B, Sq, Hq, D]
    k_lens = cache_seqlens.to(torch.long)
    q_lens = torch.full_like(k_lens, max_q)
    if block_table is not None:
        ks, vs = _paged(k_cache, block_table), _paged(v_cache, block_table)
    else:
        ks, vs = k_cache[:batch], v_cache[:batch]
    mask = _mask(q_lens, k_lens, max_q, ks.shape[1], causal, window_size, q.device)
    return _attend(q, ks, vs, mask, softmax_scale).to(q.dtype)
