"""TinyGPT's config.json fields and how they are read from TinyGPT's own config.json."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from bestiary.core.format.config import Mapping, PretrainedConfig, validate_config


class TinyGPTConfig(PretrainedConfig):
    """PretrainedConfig + TinyGPT's rotary base. Unknown fields are still errors (extra=forbid)."""

    architecture: Literal["TinyGPTForCausalLM"] = "TinyGPTForCausalLM"
    hidden_act: Literal["gelu", "gelu_new"] = "gelu"
    position_embedding_type: Literal["rope_gpt_neox"] = "rope_gpt_neox"
    rotary_base: float = Field(10000.0, description="RoPE theta.")


def from_hf_config(hf: dict, dtype: str, mapping: Mapping, source: str = "config.json") -> TinyGPTConfig:
    """TinyGPTConfig from TinyGPT's config.json (its own field names); ConfigError names a bad field."""
    data = dict(
        dtype=dtype,
        vocab_size=hf.get("vocab_size"),
        max_position_embeddings=hf.get("max_seq_len", 2048),
        hidden_size=hf.get("dim"),
        num_hidden_layers=hf.get("n_layers"),
        num_attention_heads=hf.get("n_heads"),
        intermediate_size=hf.get("ffn_dim"),
        hidden_act=hf.get("act", "gelu"),
        norm_epsilon=hf.get("norm_eps", 1e-5),
        rotary_base=hf.get("rope_theta", 10000.0),
        mapping=mapping.model_dump(),
    )
    return validate_config(TinyGPTConfig, data, source)
