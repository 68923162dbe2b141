"""The GPU scripts' flash-attn stand-in (tests/standins/flash_attn) against a
per-request reference: the batched form must give the same attention."""

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

PATH = os.path.join(os.path.dirname(__file__), "standins", "flash_attn", "__init__.py")


def standin():
    spec = importlib.util.spec_from_file_location("flash_attn_standin", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(q, k, v, scale):
    """One request: q [Lq, Hq, D], k/v [Lk, Hk, D], causal aligned bottom-right."""
    lq, lk = q.shape[0], k.shape[0]
    hq, hk = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    i = torch.arange(lq)[:, None] + (lk - lq)
    mask = torch.arange(lk)[None, :] <= i
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def paged_cache(lengths, block, hk=2, d=8, seed=0):
    """A shuffled block pool holding each request's keys, and its block table."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for n in lengths) + 1
    pool = len(lengths) * width + 3
    k = torch.randn(pool, block, hk, d, generator=g)
    v = torch.randn(pool, block, hk, d, generator=g)
    order = torch.randperm(pool, generator=g)
    table = torch.full((len(lengths), width), pool - 1, dtype=torch.int32)
    for r, n in enumerate(lengths):
        for b in range(-(-n // block)):
            table[r, b] = order[r * width + b]
    return k, v, table


def request_keys(cache, row, n):
    block = cache.shape[1]
    return cache[row[: -(-n // block)].long()].reshape(-1, cache.shape[2], cache.shape[3])[:n]


def test_decode_with_a_paged_cache_matches_the_per_request_reference():
    fa = standin()
    lengths = [5, 17, 1, 32, 9]
    k, v, table = paged_cache(lengths, block=8)
    q = torch.randn(len(lengths), 1, 4, 8)
    out = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.tensor(lengths),
                                     block_table=table, softmax_scale=0.3, causal=True)
    for r, n in enumerate(lengths):
        want = reference(q[r], request_keys(k, table[r], n), request_keys(v, table[r], n), 0.3)
        assert torch.allclose(out[r], want, atol=1e-5), r


def test_mixed_prefill_and_decode_matches_the_per_request_reference():
    fa = standin()
    k_lengths = [12, 3, 20, 7]
    q_lengths = [12, 1, 4, 1]  # a whole prompt, a decode step, a chunk, a decode step
    k, v, table = paged_cache(k_lengths, block=4, seed=1)
    q = torch.randn(sum(q_lengths), 4, 8)
    cu_q = torch.tensor([0] + list(torch.tensor(q_lengths).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(k_lengths).cumsum(0)), dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths),
                                    softmax_scale=0.25, causal=True, block_table=table)
    for r, (nq, nk) in enumerate(zip(q_lengths, k_lengths)):
        rows = slice(int(cu_q[r]), int(cu_q[r + 1]))
        want = reference(q[rows], request_keys(k, table[r], nk), request_keys(v, table[r], nk),
                         0.25)
        assert torch.allclose(out[rows], want, atol=1e-5), r


def test_grouped_query_heads_read_their_own_kv_head_and_the_cut_keys_change_nothing():
    """8 query heads over 2 KV heads (flash-attn: query head h reads KV head h // 4),
    decode and varlen, against the per-request reference that repeats K and V."""
    fa = standin()
    lengths = [3, 30, 11]
    k, v, table = paged_cache(lengths, block=8, hk=2, seed=2)
    q = torch.randn(len(lengths), 1, 8, 8)
    out = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.tensor(lengths),
                                     block_table=table, softmax_scale=0.2, causal=True)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    varlen = fa.flash_attn_varlen_func(q[:, 0], k, v, cu, cu_k, 1, max(lengths),
                                       softmax_scale=0.2, causal=True, block_table=table)
    for r, n in enumerate(lengths):
        want = reference(q[r], request_keys(k, table[r], n), request_keys(v, table[r], n), 0.2)
        assert torch.allclose(out[r], want, atol=1e-5), r
        assert torch.allclose(varlen[r], want[0], atol=1e-5), r
    # the keys past the longest context are not gathered
    assert fa._paged(k, table, max(lengths)).shape[1] == max(lengths)
