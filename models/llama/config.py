"""LLaMA's config.json fields and how they are read from an HF config."""

from __future__ import annotations

from typing import Literal

from bestiary.core.format.config import Mapping, PretrainedConfig, validate_config
from pydantic import Field


class LlamaConfig(PretrainedConfig):
    """PretrainedConfig + LLaMA's rotary, bias and tied-embedding fields."""

    architecture: Literal["LlamaForCausalLM"] = "LlamaForCausalLM"
    hidden_act: str = "silu"
    position_embedding_type: Literal["rope_gpt_neox"] = "rope_gpt_neox"
    rotary_base: float = Field(10000.0, description="RoPE theta (HF rope_theta).")
    rotary_scaling: dict | None = Field(None, description="HF rope_scaling: linear or llama3.")
    attn_bias: bool = Field(False, description="Bias on qkv and dense.")
    mlp_bias: bool = Field(False, description="Bias on fc, gate and proj.")
    tie_word_embeddings: bool = Field(False, description="lm_head shares the input embedding.")


def _rope_scaling(hf: dict) -> dict | None:
    """HF's rope_scaling (or transformers 5's rope_parameters) without the default entry."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    return {k: v for k, v in scaling.items() if k != "rope_theta"}


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))


def from_hf_config(hf: dict, dtype: str, mapping: Mapping, source: str = "config.json") -> LlamaConfig:
    """LlamaConfig from an HF LlamaConfig dict (HF's defaults where a field is absent)."""
    heads = hf.get("num_attention_heads", 32)
    hidden = hf.get("hidden_size", 4096)
    data = dict(
        dtype=dtype,
        vocab_size=hf.get("vocab_size", 32000),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        hidden_size=hidden,
        num_hidden_layers=hf.get("num_hidden_layers", 32),
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_size=hf.get("head_dim") or hidden // heads,
        hidden_act=hf.get("hidden_act", "silu"),
        intermediate_size=hf.get("intermediate_size", 11008),
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        rotary_base=_rope_theta(hf),
        rotary_scaling=_rope_scaling(hf),
        attn_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        mapping=mapping.model_dump(),
    )
    return validate_config(LlamaConfig, data, source)
