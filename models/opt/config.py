"""OPT's config.json fields and how they are read from an HF OPTConfig dict."""

from __future__ import annotations

from typing import Literal

from bestiary.core.format.config import Mapping, PretrainedConfig, validate_config
from bestiary.core.format.errors import ConfigError
from pydantic import Field, field_validator, model_validator


class OPTConfig(PretrainedConfig):
    """PretrainedConfig + OPT's norm placement, embedding projection and position offset."""

    architecture: Literal["OPTForCausalLM"] = "OPTForCausalLM"
    hidden_act: str = "relu"
    position_embedding_type: Literal["learned_absolute"] = "learned_absolute"
    do_layer_norm_before: bool = Field(
        True, description="Pre-norm layers (true) or post-norm layers without a final norm (false, OPT-350m)."
    )
    word_embed_proj_dim: int | None = Field(
        None, ge=1, description="Width of the token embedding / lm_head; project_in/out when != hidden_size."
    )
    position_offset: int = Field(2, ge=0, description="Row of the learned position table position 0 reads.")
    enable_bias: bool = Field(True, description="Bias on qkv, dense, fc and proj.")
    remove_final_layer_norm: bool = Field(
        False, description="HF _remove_final_layer_norm: no ln_f even for a pre-norm model."
    )
    tie_word_embeddings: bool = Field(True, description="lm_head shares the token embedding.")

    @field_validator("hidden_act")
    @classmethod
    def _known_activation(cls, value: str) -> str:
        from bestiary.core.layers.mlp import activation

        activation(value)  # a ValueError naming the supported ones
        return value

    @model_validator(mode="after")
    def _derive_proj_dim(self) -> "OPTConfig":
        if self.word_embed_proj_dim is None:
            object.__setattr__(self, "word_embed_proj_dim", self.hidden_size)
        return self

    @property
    def has_final_norm(self) -> bool:
        """HF builds decoder.final_layer_norm only for pre-norm models that keep it."""
        return self.do_layer_norm_before and not self.remove_final_layer_norm


def from_hf_config(hf: dict, dtype: str, mapping: Mapping, source: str = "config.json") -> OPTConfig:
    """OPTConfig from an HF OPTConfig dict (HF's defaults where a field is absent)."""
    if not hf.get("layer_norm_elementwise_affine", True):
        raise ConfigError(
            f"{source}: field 'layer_norm_elementwise_affine': false is not supported (norms without weights)"
        )
    hidden = hf.get("hidden_size", 768)
    data = dict(
        dtype=dtype,
        vocab_size=hf.get("vocab_size", 50272),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        hidden_size=hidden,
        num_hidden_layers=hf.get("num_hidden_layers", 12),
        num_attention_heads=hf.get("num_attention_heads", 12),
        hidden_act=hf.get("activation_function", "relu"),
        intermediate_size=hf.get("ffn_dim", 3072),
        norm_epsilon=1e-5,  # torch.nn.LayerNorm's default; OPT has no config field for it
        do_layer_norm_before=hf.get("do_layer_norm_before", True),
        word_embed_proj_dim=hf.get("word_embed_proj_dim") or hidden,
        enable_bias=hf.get("enable_bias", True),
        remove_final_layer_norm=hf.get("_remove_final_layer_norm", False),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        mapping=mapping.model_dump(),
    )
    return validate_config(OPTConfig, data, source)
