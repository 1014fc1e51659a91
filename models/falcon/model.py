"""Falcon's config and model: parallel (or sequential) attention + GELU MLP, LayerNorm, MQA/GQA, RoPE or ALiBi.

    x   = word_embeddings(ids)
    classic, parallel (7B)      out = x + attn(LN(x)) + mlp(LN(x))
    new decoder (40B/180B)      out = x + attn(LN_attn(x)) + mlp(LN_mlp(x))    (or one norm)
    classic, sequential (RW-1B) h = x + attn(LN(x)); out = h + mlp(LN'(h))
    mlp(y) = dense_4h_to_h(gelu(dense_h_to_4h(y)))      biases on every linear with HF `bias`
    logits = lm_head(LN_f(x))                            tied to word_embeddings

attn: neox RoPE (linear scaling only), or ALiBi (alibi_with_scale) adding
bias_h(j) = slope_h * j / sqrt(D) for key position j, with HF's bfloat16 rounding reproduced
(see `FalconAlibi`). kv heads: 1 (classic multi-query), the group count (new decoder), or all.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from bestiary.core.format.hf_config import DecoderConfig, hf_config_reader
from bestiary.core.layers.attention import alibi_slopes
from bestiary.core.layers.builder import Layout, layer_norm, standard_layer
from bestiary.core.runtime.model import DecoderLM

# HF FalconConfig's defaults (falcon-7b) by bestiary field, where config.json omits a field.
HF_DEFAULTS: dict[str, Any] = dict(vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                   max_position_embeddings=2048, norm_epsilon=1e-5, hidden_act="gelu", tie_word_embeddings=True)


class FalconConfig(DecoderConfig):
    """DecoderConfig + Falcon's layer layout and ALiBi switch.

    num_key_value_heads: 1 for classic multi-query (7B), the kv group count for the new
    decoder architecture (40B: 8), num_attention_heads for classic multi-head (RW-1B).
    """

    architecture: Literal["FalconForCausalLM"] = "FalconForCausalLM"
    hidden_act: str = "gelu"
    position_embedding_type: Literal["rope_gpt_neox", "alibi_with_scale"] = "rope_gpt_neox"
    tie_word_embeddings: bool = True
    new_decoder_architecture: bool = Field(
        False, description="Falcon-40B/180B layout: grouped kv heads, qkv interleaved per group, parallel."
    )
    parallel_attention: bool = Field(
        True, description="out = x + attn(ln(x)) + mlp(ln'(x)) instead of sequential attention, MLP."
    )
    num_ln_in_parallel_attn: Literal[1, 2] = Field(
        1, description="Norms of a parallel layer: 1 (input_layernorm) or 2 (input_layernorm, mlp_layernorm)."
    )

    @model_validator(mode="after")
    def _check_layout(self) -> FalconConfig:
        if self.new_decoder_architecture and not self.parallel_attention:
            raise ValueError("new_decoder_architecture requires parallel_attention")
        if self.num_ln_in_parallel_attn == 2 and not self.new_decoder_architecture:
            raise ValueError("num_ln_in_parallel_attn 2 requires new_decoder_architecture")
        return self

    @property
    def alibi(self) -> bool:
        """ALiBi instead of rotary (falcon-rw-1b)."""
        return self.position_embedding_type == "alibi_with_scale"


def new_decoder(hf: dict) -> bool:
    """The 40B/180B layout: HF new_decoder_architecture, or model_type RefinedWeb (the original 40B code;
    RefinedWebModel is the original 7B code, the classic layout)."""
    return bool(hf.get("new_decoder_architecture", False)) or hf.get("model_type") == "RefinedWeb"


def kv_heads(hf: dict) -> int:
    """kv heads as HF's FalconAttention uses them (classic: 1 with multi_query, else all heads)."""
    heads = hf.get("num_attention_heads") or hf.get("n_head") or HF_DEFAULTS["num_attention_heads"]
    if new_decoder(hf):
        return hf.get("num_kv_heads") or hf.get("n_head_kv") or heads
    return 1 if hf.get("multi_query") is not False else heads  # HF's default (absent or null): true


def biases(hf: dict) -> bool:
    """HF bias: a bias on every linear."""
    return bool(hf.get("bias", False))


from_hf_config = hf_config_reader(
    FalconConfig, defaults=HF_DEFAULTS, unsupported={"apply_residual_connection_post_layernorm": False},
    rope_kinds=("linear",), num_key_value_heads=kv_heads, qkv_bias=biases, dense_bias=biases, mlp_bias=biases,
    position_embedding_type=lambda hf: "alibi_with_scale" if hf.get("alibi", False) else "rope_gpt_neox",
    new_decoder_architecture=new_decoder,
    parallel_attention=lambda hf: new_decoder(hf) or hf.get("parallel_attn") is not False,
    num_ln_in_parallel_attn=lambda hf: (hf.get("num_ln_in_parallel_attn") or 2) if new_decoder(hf) else 1)


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
        layout: Layout = "parallel" if c.parallel_attention else "pre"
        alibi = self._alibi() if c.alibi else None
        return standard_layer(self, device, gated=False, rotary=alibi is None, key_bias=alibi, layout=layout,
                              parallel_norms=c.num_ln_in_parallel_attn)

    def make_final_norm(self, device) -> nn.Module:
        return layer_norm(self, device)

    def _alibi(self) -> FalconAlibi:
        """The ALiBi bias of this rank's heads, shared by every layer."""
        alibi = getattr(self, "_falcon_alibi", None)
        if alibi is None:
            c = self.config
            assert c.head_size is not None  # set by PretrainedConfig._derive
            per_rank = c.num_attention_heads // self.tp_size
            heads = range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)
            alibi = self._falcon_alibi = FalconAlibi(c.num_attention_heads, heads, c.head_size,
                                                     c.max_position_embeddings or 2048, self.dtype)
        return alibi
