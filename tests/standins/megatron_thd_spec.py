"""TEST STAND-IN (never shipped): ``--spec megatron_thd_spec local_thd_spec``.

Megatron's local (no Transformer Engine) GPT layer spec with a core attention
that accepts the packed THD sequences that ``train_rl.py`` and
``megatron.rl.rl_utils.get_logprobs`` always pass: the local
``DotProductAttention`` asserts ``packed_seq_params is None`` and Transformer
Engine is not on the GPU machine. Causal SDPA per ``cu_seqlens`` segment; no
dropout, no attention sinks. Needs ``--micro-batch-size 1`` (query ``[t, heads, dim]``).
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention


class ThdDotProductAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, None)
        if packed_seq_params.qkv_format != "thd" or query.dim() != 3:
            raise ValueError("THD attention stand-in needs --micro-batch-size 1")
        per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if per_group > 1:
            key, value = key.repeat_interleave(per_group, 1), value.repeat_interleave(per_group, 1)
        bounds = packed_seq_params.cu_seqlens_q_padded
        if bounds is None:
            bounds = packed_seq_params.cu_seqlens_q
        bounds = bounds.tolist()
        out = torch.zeros_like(query)
        # --deterministic-mode: the math kernel's backward is deterministic
        kernel = (sdpa_kernel(SDPBackend.MATH) if torch.are_deterministic_algorithms_enabled()
                  else contextlib.nullcontext())
        with kernel:
            self._attend(query, key, value, bounds, out)
        return out.reshape(out.size(0), -1)  # [t, heads*dim]; the caller reshapes

    def _attend(self, query, key, value, bounds, out):
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if stop > start:
                q, k, v = (x[start:stop].transpose(0, 1) for x in (query, key, value))
                out[start:stop] = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale).transpose(0, 1)


local_thd_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
local_thd_spec.submodules.self_attention.submodules.core_attention = ThdDotProductAttention
