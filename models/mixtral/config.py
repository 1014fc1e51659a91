"""Mixtral's config.json fields and how they are read from an HF MixtralConfig."""

from __future__ import annotations

from functools import partial
from typing import Literal

from bestiary.core.format.config import Mapping, PretrainedConfig, validate_config
from pydantic import Field, model_validator

# HF MixtralConfig's defaults (Mixtral-8x7B), used where the HF config.json omits a field.
HF_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    hidden_act="silu",
    max_position_embeddings=4096 * 32,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    num_local_experts=8,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    sliding_window=None,
)


class MixtralConfig(PretrainedConfig):
    """PretrainedConfig + Mixtral's rotary and mixture-of-experts fields.

    intermediate_size is the FFN dim of one expert.
    """

    architecture: Literal["MixtralForCausalLM"] = "MixtralForCausalLM"
    hidden_act: str = "silu"
    position_embedding_type: Literal["rope_gpt_neox"] = "rope_gpt_neox"
    rotary_base: float = Field(1e6, description="RoPE theta (HF rope_theta).")
    rotary_scaling: dict | None = Field(None, description="HF rope_scaling: linear or llama3.")
    num_local_experts: int = Field(8, ge=1, description="Experts per MoE layer (E).")
    num_experts_per_tok: int = Field(2, ge=1, description="Experts each token is routed to (top-k).")
    tie_word_embeddings: bool = Field(False, description="lm_head shares the input embedding.")
    sliding_window: int | None = Field(
        None, ge=1, description="HF sliding_window: each query attends to at most this many keys, its own "
                                "included (core.kernels.attention_window); null: full attention."
    )

    @model_validator(mode="after")
    def _check_moe(self) -> MixtralConfig:
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} > num_local_experts {self.num_local_experts}"
            )
        return self


def rope_theta(hf: dict) -> float:
    """HF rope_theta (transformers 5 keeps it in rope_parameters); Mixtral's default 1e6."""
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta", params.get("rope_theta", HF_DEFAULTS["rope_theta"])))


def rope_scaling(hf: dict) -> dict | None:
    """HF rope_scaling / rope_parameters without rope_theta, or None for the default rope."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"}


def max_positions(hf: dict) -> int:
    """max_position_embeddings (the sliding window does not cap it: attention runs through the window)."""
    return hf.get("max_position_embeddings", HF_DEFAULTS["max_position_embeddings"])


def hf_field(hf: dict, name: str):
    """HF config field `name`, or HF's default when it is absent or null."""
    value = hf.get(name)
    return HF_DEFAULTS[name] if value is None else value


def from_hf_config(hf: dict, dtype: str, mapping: Mapping, source: str = "config.json") -> MixtralConfig:
    """MixtralConfig from an HF MixtralConfig dict (HF's defaults where a field is absent)."""
    get = partial(hf_field, hf)
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    kv_heads = hf.get("num_key_value_heads", HF_DEFAULTS["num_key_value_heads"])  # null: one per query head
    data = dict(
        dtype=dtype,
        vocab_size=get("vocab_size"),
        max_position_embeddings=max_positions(hf),
        hidden_size=hidden,
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=heads if kv_heads is None else kv_heads,
        head_size=hf.get("head_dim") or hidden // heads,
        hidden_act=get("hidden_act"),
        intermediate_size=get("intermediate_size"),
        norm_epsilon=get("rms_norm_eps"),
        rotary_base=rope_theta(hf),
        rotary_scaling=rope_scaling(hf),
        num_local_experts=get("num_local_experts"),
        num_experts_per_tok=get("num_experts_per_tok"),
        tie_word_embeddings=get("tie_word_embeddings"),
        sliding_window=hf.get("sliding_window"),
        mapping=mapping.model_dump(),
    )
    return validate_config(MixtralConfig, data, source)
