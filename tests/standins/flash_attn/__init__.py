"""TEST STAND-IN (never shipped): a pure-PyTorch stand-in for the two flash-attn 2 entry points that Megatron's
dynamic inference engine calls (megatron/core/transformer/attention.py:
flash_decode_and_prefill). Paged KV cache: k/v [num_blocks, block_size, H_kv, D],
block_table [batch, max_blocks]. Slow (a Python loop over requests, host syncs);
for functional tests only: flash-attn has no wheel for the GPU machine, and
Megatron's dynamic inference engine has no other attention path. Results that
used it say so. No CUDA graphs (keep --inference-cuda-graph-scope none)."""
import torch
import torch.nn.functional as F

__version__ = "2.8.3"  # attention.py:1330 asserts is_fa_min_version("2.7.3")


def _gather(cache, row, n):
    bs = cache.shape[1]
    nblk = (n + bs - 1) // bs
    return cache[row[:nblk].long()].reshape(-1, cache.shape[2], cache.shape[3])[:n]


def _attend(q, k, v, scale, causal, window_size=(-1, -1)):
    # q [Lq, Hq, D], k/v [Lk, Hk, D]; flash-attn aligns the causal mask bottom-right
    lq, hq, _ = q.shape
    lk, hk, _ = k.shape
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    mask = None
    if causal or (window_size is not None and window_size[0] >= 0):
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=q.device)[None, :]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            mask &= j <= i
        if window_size is not None and window_size[0] >= 0:
            mask &= j >= i - window_size[0]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), block_table=None, return_attn_probs=False,
                           **_):
    if return_attn_probs:
        raise NotImplementedError("flash_attn shim: no LSE (attention sinks unsupported)")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    for b in range(len(cq) - 1):
        n = ck[b + 1] - ck[b]
        if block_table is not None:
            ks, vs = _gather(k, block_table[b], n), _gather(v, block_table[b], n)
        else:
            ks, vs = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        out[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], ks, vs, softmax_scale, causal,
                                        window_size)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), num_splits=0, return_softmax_lse=False,
                            **_):
    if k is not None or v is not None or return_softmax_lse:
        raise NotImplementedError("flash_attn shim: only the paged read path is implemented")
    lens = cache_seqlens.tolist()
    out = torch.empty_like(q)  # q [B, Sq, Hq, D]
    for b, n in enumerate(lens):
        if block_table is not None:
            ks, vs = _gather(k_cache, block_table[b], n), _gather(v_cache, block_table[b], n)
        else:
            ks, vs = k_cache[b, :n], v_cache[b, :n]
        out[b] = _attend(q[b], ks, vs, softmax_scale, causal, window_size)
    return out
