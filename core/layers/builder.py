"""The decoder layer every family builds from its config, in one of three layouts:

    pre       h = x + attention(norm(x));   out = h + mlp(norm(h))             (LLaMA, GPT-2, BLOOM, ...)
    post      h = norm(x + attention(x));   out = norm(h + mlp(h))             (OPT-350m)
    parallel  out = x + attention(norm(x)) + mlp(norm'(x))   norm' = norm, or its own (two norms)   (Falcon)
    scaled    a = norm(x); h = alpha a + attention(a); m = norm(h); out = alpha m + mlp(m)   (ChatGLM v1)
    output    h = x + norm(attention(x));   out = h + norm(mlp(h))             (Exaone4, OLMo2)
    sandwich  h = x + norm(attention(norm(x)));   out = h + norm(mlp(norm(h)))  (Gemma 2 / 3)

attention: fused qkv (biases per config: qkv_bias, dense_bias), rotary (the config's RoPE,
model.make_rotary) or ALiBi slopes or a family's key bias, GQA / MHA. mlp: SwiGLU (GatedMLP)
or act(fc) proj (MLP) over (hidden_size, intermediate_size, hidden_act, mlp_bias), or the
family's own block (a MoE). `norm` is the model's own norm kind (`model.make_final_norm`:
`rms_norm` or `layer_norm` below, or the family's `norm=` where its final norm differs, OPT-350m's
none), one fresh module per place.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal, get_args

import torch
from torch import nn

from bestiary.core.kernels.metadata import KeyBias
from bestiary.core.layers.attention import PagedAttention
from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.mlp import MLP, GatedMLP
from bestiary.core.layers.norm import LayerNorm, RMSNorm
from bestiary.core.layers.output_norm_decoder_layer import OutputNormDecoderLayer
from bestiary.core.layers.parallel_decoder_layer import ParallelDecoderLayer
from bestiary.core.layers.post_norm_decoder_layer import PostNormDecoderLayer
from bestiary.core.layers.rotary import Rotary
from bestiary.core.layers.sandwich_norm_decoder_layer import SandwichNormDecoderLayer
from bestiary.core.layers.scaled_residual_layer import ScaledResidualLayer
from bestiary.core.layers.self_attention import SelfAttention

Layout = Literal["pre", "post", "parallel", "scaled", "output", "sandwich"]
LAYOUTS: tuple[str, ...] = get_args(Layout)


def standard_layer(
    model, device, *, mlp: nn.Module | None = None, gated: bool = True, rotary: bool | Rotary = True,
    alibi: torch.Tensor | None = None, key_bias: KeyBias | None = None, scale: float | None = None,
    layout: Layout = "pre", parallel_norms: int = 1, norm: Callable[[Any, Any], nn.Module] | None = None,
    alpha: float = 1.0, qk_norm: bool | Callable[[int], nn.Module] = False, attn: PagedAttention | None = None,
    softcap: float | None = None, sink_logits: bool = False, attention: nn.Module | None = None,
) -> nn.Module:
    """The layer of `model` (a DecoderLM whose config is a core.format.hf_config.DecoderConfig).

    rotary: the config's RoPE (model.make_rotary()), or the given rotary module (Gemma 3's local layers);
    alibi: this rank's slopes [H_local] instead;
    key_bias: a family's own additive key bias (a callable k_pos [L] -> [H_local, L], e.g. Falcon's
    bf16-rounded ALiBi); scale: the attention score scale (default 1/sqrt(head_size)). mlp: the
    feed-forward block, default GatedMLP (gated) or MLP. layout: see the module doc;
    parallel_norms: 1 (the MLP reads the attention's norm) or 2 (its own); alpha: the residual scale of
    the scaled layout; qk_norm: an RMSNorm over each q and k head before rotary (Exaone4), or `(D) -> norm`
    (Gemma 3's 1 + w); attn: the family's own attention op instead of PagedAttention (Qwen's logn scaling);
    attention: the family's whole attention block instead of SelfAttention (DeepSeek's latent attention,
    core.layers.latent_attention; the attention arguments above are then unused);
    softcap: the attention-logit soft-cap c tanh(s / c) of PagedAttention (Gemma 2); sink_logits: a learned
    logit per query head in the attention softmax's denominator (PagedAttention.sink_logits, gpt-oss).
    norm: `(model, device) -> module` of the layer norms (default: the model's final norm kind,
    model.make_final_norm)."""
    if layout not in LAYOUTS:
        raise ValueError(f"standard_layer: layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    c, place = model.config, model.placement(device)
    head_norm = qk_norm if callable(qk_norm) else \
        partial(RMSNorm, eps=c.norm_epsilon, dtype=model.dtype, device=device) if qk_norm else None
    if softcap is not None or sink_logits:
        if attn is not None:
            named = "softcap" if softcap is not None else "sink_logits"
            raise ValueError(f"standard_layer: {named} and a family's own attn op (give the op its {named})")
        heads = c.num_attention_heads // place["tp_size"] if sink_logits else 0
        attn = PagedAttention(c.head_size, scale, alibi, key_bias, softcap=softcap, sink_heads=heads,
                              dtype=model.dtype, device=device)
    rope = rotary if isinstance(rotary, Rotary) else model.make_rotary() if rotary and attention is None else None
    attention = attention or SelfAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                              qkv_bias=c.qkv_bias, dense_bias=c.dense_bias, scale=scale, rotary=rope, alibi=alibi,
                              key_bias=key_bias, qk_norm=head_norm, attn=attn, **place)
    if mlp is None:
        mlp = (GatedMLP if gated else MLP)(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, **place)
    make = (lambda: norm(model, device)) if norm else (lambda: model.make_final_norm(device))
    if layout == "parallel":
        return ParallelDecoderLayer(make(), attention, mlp, make() if parallel_norms == 2 else None)
    if layout == "output":
        return OutputNormDecoderLayer(attention, make(), mlp, make())
    if layout == "scaled":
        return ScaledResidualLayer(make(), attention, make(), mlp, alpha)
    if layout == "sandwich":
        return SandwichNormDecoderLayer(make(), attention, make(), make(), mlp, make())
    layer = PreNormDecoderLayer if layout == "pre" else PostNormDecoderLayer
    return layer(make(), attention, make(), mlp)


def rms_norm(model, device) -> RMSNorm:
    """RMSNorm over hidden_size with the config's norm_epsilon, in the model's dtype."""
    return RMSNorm(model.config.hidden_size, model.config.norm_epsilon, model.dtype, device)


def layer_norm(model, device) -> LayerNorm:
    """LayerNorm (weight and bias) over hidden_size with the config's norm_epsilon, in the model's dtype."""
    return LayerNorm(model.config.hidden_size, model.config.norm_epsilon, bias=True, dtype=model.dtype, device=device)
