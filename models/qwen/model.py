"""Qwen-1's config and model: the shared RMSNorm / RoPE / SwiGLU layer, c_attn with bias, logn scaling.

    x   = wte(ids)
    h   = x + c_proj(attention(c_attn(ln_1(x))))       q scaled by logn(p) when use_logn_attn
    out = h + c_proj(w1(y) * silu(w2(y))),  y = ln_2(h)
    logits = lm_head(ln_f(x))

logn(p) = log(p + 1) / log(seq_length) for a query at position p with p + 1 > seq_length, else 1
(upstream's logn_tensor). Dynamic NTK (use_dynamic_ntk) re-bases the rotary past seq_length per
prompt; bestiary does not, so such configs are capped at seq_length, where NTK and logn are both 1.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from bestiary.core.format.hf_config import DecoderConfig, first_present, hf_config_reader
from bestiary.core.layers.attention import AttentionMetadata, PagedAttention
from bestiary.core.layers.builder import rms_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM


class QwenConfig(DecoderConfig):
    """DecoderConfig + Qwen-1's training length and logn switch; intermediate_size is w1's width (HF's / 2)."""

    architecture: Literal["QWenLMHeadModel"] = "QWenLMHeadModel"
    qkv_bias: bool = True
    seq_length: int = Field(2048, ge=2, description="Training length: logn scaling starts past it.")
    use_logn_attn: bool = Field(True, description="Scale queries past seq_length by log(p + 1) / log(seq_length).")


QWEN_FFN = 22016  # QWenConfig's intermediate_size (both halves of the gated MLP)


def max_positions(hf: dict) -> int:
    """max_position_embeddings, capped at seq_length under use_dynamic_ntk (see the module doc)."""
    max_pos = first_present(hf, ("max_position_embeddings", "n_positions")) or 8192
    seq = hf.get("seq_length") or max_pos
    return min(max_pos, seq) if hf.get("use_dynamic_ntk") is not False else max_pos


from_hf_config = hf_config_reader(
    QwenConfig, defaults={"norm_epsilon": 1e-6},
    max_position_embeddings=max_positions, qkv_bias=True,
    dense_bias=lambda hf: hf.get("no_bias") is False, mlp_bias=lambda hf: hf.get("no_bias") is False,
    intermediate_size=lambda hf: (first_present(hf, ("intermediate_size", "ffn_hidden_size")) or QWEN_FFN) // 2)


class LognPagedAttention(PagedAttention):
    """PagedAttention on queries scaled by logn(position): q [T, H, D] -> q * logn(p_t)."""

    def __init__(self, head_dim: int, seq_length: int) -> None:
        super().__init__(head_dim)
        self.seq_length = seq_length

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        n = meta.positions.to(torch.float64) + 1  # [T] key count at each query
        logn = torch.where(n > self.seq_length, n.log() / math.log(self.seq_length), torch.ones_like(n))
        return super().forward(q * logn.to(q.dtype)[:, None, None], k, v, meta, k_pool, v_pool)


class QWenLMHeadModel(DecoderLM):
    """Qwen-1.8B / 7B / 14B / 72B (Base and Chat)."""

    config: QwenConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        assert c.head_size is not None  # set by PretrainedConfig._derive
        logn = c.use_logn_attn and (c.max_position_embeddings or 0) > c.seq_length
        return standard_layer(self, device, attn=LognPagedAttention(c.head_size, c.seq_length) if logn else None)

    def make_final_norm(self, device) -> nn.Module:
        return rms_norm(self, device)
