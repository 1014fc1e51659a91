"""TinyGPT's model, composed from bestiary's core layers, and its one postprocess hook.

    h   = x + attention(LayerNorm(x))       rotary (neox) on q and k, causal
    out = h + proj(gelu(fc(LayerNorm(h))))
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.mlp import MLP
from bestiary.core.layers.norm import LayerNorm
from bestiary.core.layers.rotary import Rotary
from bestiary.core.layers.self_attention import SelfAttention
from bestiary.core.runtime.model import DecoderLM
from bestiary_tinygpt.config import TinyGPTConfig


class TinyGPTForCausalLM(DecoderLM):
    """The decoder of one (tp, pp) rank; module paths are the checkpoint's canonical names."""

    config: TinyGPTConfig

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        c = self.config
        tp = dict(tp_rank=self.tp_rank, tp_size=self.tp_size)
        rotary = Rotary(c.head_size, c.head_size, c.rotary_base, None, c.max_position_embeddings or 2048,
                        style="neox")
        attention = SelfAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                                  qkv_bias=True, dense_bias=True, rotary=rotary, dtype=self.dtype,
                                  device=device, **tp)
        mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=True, dtype=self.dtype, device=device,
                  **tp)
        return PreNormDecoderLayer(self.make_final_norm(device), attention, self.make_final_norm(device), mlp)

    def make_final_norm(self, device) -> nn.Module:
        return LayerNorm(self.config.hidden_size, self.config.norm_epsilon, bias=True, dtype=self.dtype,
                         device=device)


def qkv_from_per_head(key: str, tensors: list[torch.Tensor], config: TinyGPTConfig) -> dict[str, torch.Tensor]:
    """TinyGPT's wqkv rows (q_h, k_h, v_h for each head h) -> bestiary's [Q; K; V], head-major.

    The loader has already cut this rank's rows: a contiguous 1/tp of the per-head layout
    is exactly this rank's heads, so the reorder works on any rank.
    wqkv [H_r * 3 * D, ...] -> [3 * H_r * D, ...] (weight [.., hidden] or bias [..]).
    """
    (wqkv,) = tensors
    d = config.head_size
    heads = wqkv.shape[0] // (3 * d)  # this rank's heads, H_r
    per_head = wqkv.reshape(heads, 3, d, *wqkv.shape[1:])  # [H_r, 3, D, ...]
    return {key: per_head.transpose(0, 1).reshape(wqkv.shape)}  # [3, H_r, D, ...] -> [3 H_r D, ...]
