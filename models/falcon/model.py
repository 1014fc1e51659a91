"""Falcon: parallel (or sequential) attention + GELU MLP, LayerNorm, MQA/GQA, RoPE or ALiBi.

    classic, parallel (7B)      out = x + attn(ln(x)) + mlp(ln(x))
    new decoder (40B/180B)      out = x + attn(ln_attn(x)) + mlp(ln_mlp(x))    (or one norm)
    classic, sequential (RW-1B) h = x + attn(ln(x)); out = h + mlp(ln'(h))

ALiBi (alibi_with_scale) adds bias_h(j) = slope_h * j / sqrt(D) for key position j, with
HF's bfloat16 rounding reproduced (see `FalconAlibi`).
"""

from __future__ import annotations

import math

import torch
from bestiary.core.layers.attention import alibi_slopes
from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.mlp import MLP
from bestiary.core.layers.norm import LayerNorm
from bestiary.core.layers.parallel_decoder_layer import ParallelDecoderLayer
from bestiary.core.layers.rotary import Rotary
from bestiary.core.layers.self_attention import SelfAttention
from bestiary.core.runtime.model import DecoderLM
from bestiary.models.falcon.config import FalconConfig
from torch import nn


class FalconAlibi:
    """Falcon's ALiBi key bias, computed exactly as HF transformers does.

    bias_h(j) = float(bf16(bf16(slope_h) * j)) / sqrt(D) for key position j, for this
    rank's heads. HF rounds the slopes and their products with the key positions to
    bfloat16 even in fp32 models (build_alibi_tensor) and divides by sqrt(D) afterwards;
    past 256 positions that rounding moves the bias by up to slope_h * 2^-8 * j, far more
    than the 1e-4 parity tolerance, so we reproduce it rather than use exact slopes. The
    bias is a function of j alone, equivalent under the softmax to slope_h * (j - i).
    Not an nn.Module: it holds no weights; the table is built on first use (so never on
    the meta device the model is constructed on).
    """

    def __init__(
        self, num_heads: int, heads: range, head_dim: int, max_positions: int, dtype: torch.dtype
    ) -> None:
        self.num_heads, self.heads = num_heads, heads  # all heads, this rank's heads
        self.head_dim, self.max_positions, self.dtype = head_dim, max_positions, dtype
        self._table: torch.Tensor | None = None  # [H_local, P]

    def _build(self, size: int, device: torch.device) -> torch.Tensor:
        slopes = alibi_slopes(self.num_heads)[self.heads.start : self.heads.stop]
        j = torch.arange(size, device=device)  # int64 key positions, as HF's cumsum of the mask
        product = slopes.to(device, torch.bfloat16)[:, None] * j[None, :]  # bf16 [H_local, P]
        return product.to(self.dtype) / math.sqrt(self.head_dim)

    def __call__(self, k_pos: torch.Tensor) -> torch.Tensor:
        """k_pos [L] -> bias [H_local, L]."""
        needed = int(k_pos.max()) + 1 if k_pos.numel() else 1
        table = self._table
        if table is None or table.device != k_pos.device or table.shape[1] < needed:
            table = self._table = self._build(max(needed, self.max_positions), k_pos.device)
        return table.index_select(1, k_pos)


class FalconForCausalLM(DecoderLM):
    """Falcon 7B / 40B / 180B and the RW models."""

    config: FalconConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        tp = dict(tp_rank=self.tp_rank, tp_size=self.tp_size)
        rotary = None if c.alibi else Rotary(c.head_size, c.head_size, c.rotary_base, c.rotary_scaling,
                                             c.max_position_embeddings or 2048, style="neox")
        attention = SelfAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                                  qkv_bias=c.bias, dense_bias=c.bias, rotary=rotary,
                                  key_bias=self._alibi() if c.alibi else None,
                                  dtype=self.dtype, device=device, **tp)
        mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.bias, dtype=self.dtype, device=device,
                  **tp)
        if not c.parallel_attention:
            return PreNormDecoderLayer(self._layer_norm(device), attention, self._layer_norm(device), mlp)
        mlp_norm = self._layer_norm(device) if c.num_ln_in_parallel_attn == 2 else None
        return ParallelDecoderLayer(self._layer_norm(device), attention, mlp, mlp_norm)

    def make_final_norm(self, device) -> nn.Module:
        return self._layer_norm(device)

    def _layer_norm(self, device) -> LayerNorm:
        c = self.config
        return LayerNorm(c.hidden_size, c.norm_epsilon, bias=True, dtype=self.dtype, device=device)

    def _alibi(self) -> FalconAlibi:
        """The ALiBi bias of this rank's heads, shared by every layer."""
        alibi = getattr(self, "_falcon_alibi", None)
        if alibi is None:
            c = self.config
            per_rank = c.num_attention_heads // self.tp_size
            heads = range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)
            alibi = self._falcon_alibi = FalconAlibi(c.num_attention_heads, heads, c.head_size,
                                                     c.max_position_embeddings or 2048, self.dtype)
        return alibi
