"""BLOOM's config and model: ALiBi, LayerNorm everywhere (the embeddings too), MHA with biases.

    x   = LayerNorm(word_embeddings(ids))
    h   = x + dense(attention(LayerNorm(x)))     scores = q k^T / sqrt(D) + m_h j   (ALiBi, core.layers.alibi)
    out = h + dense_4h_to_h(gelu_tanh(dense_h_to_4h(LayerNorm(h))))
    logits = ln_f(x) word_embeddings^T
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from bestiary.core.format.hf_config import DecoderConfig, hf_config_reader
from bestiary.core.layers.alibi import rank_alibi_slopes
from bestiary.core.layers.builder import standard_layer
from bestiary.core.layers.norm import LayerNorm
from bestiary.core.runtime.model import DecoderLM


class BloomConfig(DecoderConfig):
    """DecoderConfig for BLOOM: ALiBi, biases everywhere, tanh GELU, tied lm_head."""

    architecture: Literal["BloomForCausalLM"] = "BloomForCausalLM"
    hidden_act: str = "gelu_pytorch_tanh"
    position_embedding_type: Literal["alibi"] = "alibi"
    qkv_bias: bool = True
    dense_bias: bool = True
    mlp_bias: bool = True
    tie_word_embeddings: bool = True


# HF BLOOM has no activation field (bloom_gelu is the tanh approximation) and no position limit (ALiBi).
from_hf_config = hf_config_reader(
    BloomConfig, defaults={"norm_epsilon": 1e-5, "tie_word_embeddings": True},
    unsupported={"apply_residual_connection_post_layernorm": False},
    hidden_act="gelu_pytorch_tanh")


class BloomForCausalLM(DecoderLM):
    """BLOOM 560m to 176B, BLOOMZ."""

    config: BloomConfig

    def make_top_level_modules(self, device) -> dict[str, nn.Module]:
        """The embedding LayerNorm (word_embeddings_layernorm) on the first pipeline stage."""
        return {"ln_embed": self.make_final_norm(device)} if self.is_first_stage else {}

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        slopes = rank_alibi_slopes(self.config.num_attention_heads, self.tp_rank, self.tp_size)
        return standard_layer(self, device, gated=False, rotary=False, alibi=slopes)

    def make_final_norm(self, device) -> nn.Module:
        c = self.config
        return LayerNorm(c.hidden_size, c.norm_epsilon, bias=True, dtype=self.dtype, device=device)
