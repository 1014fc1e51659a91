"""GPT-2's config and model: learned positions, pre-norm LayerNorm layers, MHA with biases, GELU MLP.

    x   = wte(ids) + wpe(positions)
    h   = x + attention(ln_1(x))         scores = q k^T * s,  s = 1/sqrt(D) (1 without scale_attn_weights),
                                         divided by layer_idx + 1 with scale_attn_by_inverse_layer_idx
    out = h + proj(gelu_new(fc(ln_2(h))))
    logits = ln_f(x) wte^T
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import nn

from bestiary.core.format.hf_config import DecoderConfig, hf_config_reader
from bestiary.core.layers.builder import standard_layer
from bestiary.core.layers.norm import LayerNorm
from bestiary.core.layers.position_embedding import LearnedPositionEmbedding
from bestiary.core.runtime.model import DecoderLM


class GPT2Config(DecoderConfig):
    """DecoderConfig + GPT-2's attention scaling switches; biases everywhere, tied lm_head."""

    architecture: Literal["GPT2LMHeadModel"] = "GPT2LMHeadModel"
    hidden_act: str = "gelu_new"
    position_embedding_type: Literal["learned_absolute"] = "learned_absolute"
    qkv_bias: bool = True
    dense_bias: bool = True
    mlp_bias: bool = True
    tie_word_embeddings: bool = True
    scale_attn_weights: bool = Field(True, description="Scores scaled by 1/sqrt(head_size) (else unscaled).")
    scale_attn_by_inverse_layer_idx: bool = Field(False, description="Scores of layer i divided by i + 1.")


from_hf_config = hf_config_reader(
    GPT2Config, defaults={"norm_epsilon": 1e-5, "hidden_act": "gelu_new", "max_position_embeddings": 1024,
                          "tie_word_embeddings": True})


class GPT2LMHeadModel(DecoderLM):
    """GPT-2 small to XL, DistilGPT-2."""

    config: GPT2Config

    def make_top_level_modules(self, device) -> dict[str, nn.Module]:
        """wpe on the first pipeline stage."""
        if not self.is_first_stage:
            return {}
        c = self.config
        return {"position_embedding": LearnedPositionEmbedding(c.max_position_embeddings or 1024, c.hidden_size,
                                                               dtype=self.dtype, device=device)}

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        return standard_layer(self, device, gated=False, rotary=False, scale=self.attention_scale(layer_idx))

    def attention_scale(self, layer_idx: int) -> float:
        """s of layer `layer_idx` (see the module doc)."""
        c = self.config
        assert c.head_size is not None  # set by PretrainedConfig._derive
        scale = c.head_size**-0.5 if c.scale_attn_weights else 1.0
        return scale / (layer_idx + 1) if c.scale_attn_by_inverse_layer_idx else scale

    def make_final_norm(self, device) -> nn.Module:
        c = self.config
        return LayerNorm(c.hidden_size, c.norm_epsilon, bias=True, dtype=self.dtype, device=device)
