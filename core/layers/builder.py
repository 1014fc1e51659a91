"""The pre-norm decoder layer most families share, built from the model's config:

    h   = x + attention(norm(x))     fused qkv (biases per config), rotary or ALiBi, GQA / MHA
    out = h + mlp(norm(h))           SwiGLU (GatedMLP) or act(fc) proj (MLP), or the family's own (a MoE)

`norm` is the model's own final-norm kind (`model.make_final_norm`: RMSNorm for Mistral, Qwen2,
Qwen2-MoE, Qwen-1, Baichuan; LayerNorm for GPT-2, BLOOM).
"""

from __future__ import annotations

import torch
from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.mlp import MLP, GatedMLP
from bestiary.core.layers.norm import RMSNorm
from bestiary.core.layers.self_attention import SelfAttention
from torch import nn


def standard_layer(
    model, device, mlp: nn.Module | None = None, gated: bool = True, rotary: bool = True,
    alibi: torch.Tensor | None = None, scale: float | None = None,
) -> PreNormDecoderLayer:
    """The layer of `model` (a DecoderLM whose config is a core.format.hf_config.DecoderConfig).

    rotary: the config's RoPE (model.make_rotary()); alibi: this rank's slopes [H_local] instead;
    scale: the attention score scale (default 1/sqrt(head_size)). mlp: the feed-forward block, default
    GatedMLP (gated) or MLP over (hidden, intermediate, act, mlp_bias)."""
    c, place = model.config, model.placement(device)
    attention = SelfAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                              qkv_bias=c.qkv_bias, dense_bias=c.dense_bias, scale=scale,
                              rotary=model.make_rotary() if rotary else None, alibi=alibi, **place)
    if mlp is None:
        mlp = (GatedMLP if gated else MLP)(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, **place)
    return PreNormDecoderLayer(model.make_final_norm(device), attention, model.make_final_norm(device), mlp)


def rms_norm(model, device) -> RMSNorm:
    """RMSNorm over hidden_size with the config's norm_epsilon, in the model's dtype."""
    return RMSNorm(model.config.hidden_size, model.config.norm_epsilon, model.dtype, device)
