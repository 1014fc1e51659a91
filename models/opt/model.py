"""OPT's config and model: learned positions, LayerNorm pre- or post-norm layers, MHA with biases, ReLU MLP.

    x   = project_in(vocab_embedding(ids)) + position_embedding(positions + 2)   # project_in: P -> H
    pre-norm:   h = x + attention(LN(x));   out = h + fc2(relu(fc1(LN(h))))
    post-norm:  h = LN(x + attention(x));   out = LN(h + fc2(relu(fc1(h))))      (OPT-350m)
    logits = lm_head(project_out(ln_f(x)))    # ln_f: pre-norm models only; project_out: H -> P

P = word_embed_proj_dim (the token embedding / lm_head width), H = hidden_size; the
projections exist only when P != H (OPT-350m).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from torch import nn

from bestiary.core.format.hf_config import DecoderConfig, hf_config_reader
from bestiary.core.layers.builder import Layout, layer_norm, standard_layer
from bestiary.core.layers.linear import Linear
from bestiary.core.layers.position_embedding import LearnedPositionEmbedding
from bestiary.core.runtime.model import DecoderLM

# HF OPTConfig's defaults (opt-125m) by bestiary field; OPT has no norm epsilon field (torch's 1e-5).
HF_DEFAULTS = dict(vocab_size=50272, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, max_position_embeddings=2048, hidden_act="relu", norm_epsilon=1e-5,
                   tie_word_embeddings=True)


class OPTConfig(DecoderConfig):
    """DecoderConfig + OPT's norm placement, embedding projection and position offset; biases on every linear."""

    architecture: Literal["OPTForCausalLM"] = "OPTForCausalLM"
    hidden_act: str = "relu"
    position_embedding_type: Literal["learned_absolute"] = "learned_absolute"
    qkv_bias: bool = True
    dense_bias: bool = True
    mlp_bias: bool = True
    tie_word_embeddings: bool = True
    do_layer_norm_before: bool = Field(
        True, description="Pre-norm layers (true) or post-norm layers without a final norm (false, OPT-350m)."
    )
    word_embed_proj_dim: int | None = Field(
        None, ge=1, description="Width of the token embedding / lm_head; project_in/out when != hidden_size."
    )
    position_offset: int = Field(2, ge=0, description="Row of the learned position table position 0 reads.")
    remove_final_layer_norm: bool = Field(
        False, description="HF _remove_final_layer_norm: no ln_f even for a pre-norm model."
    )

    @model_validator(mode="after")
    def _derive_proj_dim(self) -> OPTConfig:
        if self.word_embed_proj_dim is None:
            object.__setattr__(self, "word_embed_proj_dim", self.hidden_size)
        return self

    @property
    def embed_dim(self) -> int:
        """word_embed_proj_dim, set by validation (hidden_size when the source gives none)."""
        assert self.word_embed_proj_dim is not None, "set by _derive_proj_dim"
        return self.word_embed_proj_dim

    @property
    def has_final_norm(self) -> bool:
        """HF builds decoder.final_layer_norm only for pre-norm models that keep it."""
        return self.do_layer_norm_before and not self.remove_final_layer_norm


def biases(hf: dict) -> bool:
    """HF enable_bias (default true, null included): a bias on every linear."""
    return hf.get("enable_bias") is not False


from_hf_config = hf_config_reader(
    OPTConfig, defaults=HF_DEFAULTS, unsupported={"layer_norm_elementwise_affine": True},
    qkv_bias=biases, dense_bias=biases, mlp_bias=biases, norm_epsilon=1e-5,
    remove_final_layer_norm=lambda hf: hf.get("_remove_final_layer_norm") is True)


class OPTForCausalLM(DecoderLM):
    """OPT 125m-66b (350m's projected embeddings and post-norm layers included)."""

    config: OPTConfig

    def make_top_level_modules(self, device) -> dict[str, nn.Module]:
        """position_embedding and project_in on the first stage, project_out on the last (P != H only)."""
        c, place = self.config, {"dtype": self.dtype, "device": device}
        extra: dict[str, nn.Module] = {}
        if self.is_first_stage:
            extra["position_embedding"] = LearnedPositionEmbedding(
                c.max_position_embeddings or 2048, c.hidden_size, c.position_offset, **place)
            if self.projected:
                extra["project_in"] = Linear(c.embed_dim, c.hidden_size, **place)
        if self.is_last_stage and self.projected:
            extra["project_out"] = Linear(c.hidden_size, c.embed_dim, **place)
        return extra

    @property
    def projected(self) -> bool:
        """Token embeddings are narrower/wider than the layers (OPT-350m): project_in/out exist."""
        return self.config.embed_dim != self.config.hidden_size

    @property
    def embedding_dim(self) -> int:
        return self.config.embed_dim

    def make_layer(self, layer_idx: int, device) -> nn.Module:
        layout: Layout = "pre" if self.config.do_layer_norm_before else "post"
        return standard_layer(self, device, gated=False, rotary=False, layout=layout, norm=layer_norm)

    def make_final_norm(self, device) -> nn.Module:
        return layer_norm(self, device) if self.config.has_final_norm else nn.Identity()
