"""Falcon's config.json fields and how they are read from an HF FalconConfig / RW config dict."""

from __future__ import annotations

from typing import Literal

from bestiary.core.format.config import Mapping, PretrainedConfig, validate_config
from bestiary.core.format.errors import ConfigError
from pydantic import Field, field_validator, model_validator


class FalconConfig(PretrainedConfig):
    """PretrainedConfig + Falcon's layer layout, bias and rotary fields.

    num_key_value_heads: 1 for classic multi-query (7B), the kv group count for the new
    decoder architecture (40B: 8), num_attention_heads for classic multi-head (RW-1B).
    """

    architecture: Literal["FalconForCausalLM"] = "FalconForCausalLM"
    hidden_act: str = "gelu"
    position_embedding_type: Literal["rope_gpt_neox", "alibi_with_scale"] = "rope_gpt_neox"
    bias: bool = Field(False, description="Bias on qkv, dense, fc and proj.")
    new_decoder_architecture: bool = Field(
        False, description="Falcon-40B/180B layout: grouped kv heads, qkv interleaved per group, parallel."
    )
    parallel_attention: bool = Field(
        True, description="out = x + attn(ln(x)) + mlp(ln'(x)) instead of sequential attention, MLP."
    )
    num_ln_in_parallel_attn: Literal[1, 2] = Field(
        1, description="Norms of a parallel layer: 1 (input_layernorm) or 2 (input_layernorm, mlp_layernorm)."
    )
    rotary_base: float = Field(10000.0, description="RoPE theta (HF rope_theta).")
    rotary_scaling: dict | None = Field(None, description="HF rope scaling (linear only).")
    tie_word_embeddings: bool = Field(True, description="lm_head shares the input embedding.")

    @field_validator("hidden_act")
    @classmethod
    def _known_activation(cls, value: str) -> str:
        from bestiary.core.layers.mlp import activation

        activation(value)  # a ValueError naming the supported ones
        return value

    @model_validator(mode="after")
    def _check_layout(self) -> "FalconConfig":
        if self.new_decoder_architecture and not self.parallel_attention:
            raise ValueError("new_decoder_architecture requires parallel_attention")
        if self.num_ln_in_parallel_attn == 2 and not self.new_decoder_architecture:
            raise ValueError("num_ln_in_parallel_attn 2 requires new_decoder_architecture")
        return self

    @property
    def alibi(self) -> bool:
        """ALiBi instead of rotary (falcon-rw-1b)."""
        return self.position_embedding_type == "alibi_with_scale"


def _rope(hf: dict, source: str) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's rope_parameters or the older rope_theta / rope_scaling."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or params
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "linear":
        raise ConfigError(f"{source}: field 'rope_scaling': rope_type {kind!r} unsupported (only linear)")
    return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}


def _kv_heads(hf: dict, heads: int, new_decoder: bool) -> int:
    """kv heads as HF's FalconAttention uses them (classic: 1 with multi_query, else all heads)."""
    if new_decoder:
        return hf.get("num_kv_heads") or hf.get("n_head_kv") or heads
    return 1 if hf.get("multi_query", True) else heads


def from_hf_config(hf: dict, dtype: str, mapping: Mapping, source: str = "config.json") -> FalconConfig:
    """FalconConfig from an HF FalconConfig dict or an RW config (HF's defaults where a field is absent).

    model_type RefinedWeb (the original 40B code) means the new decoder architecture,
    RefinedWebModel (the original 7B code) the classic one; n_embed/n_layer/n_head/n_head_kv
    are the RW names.
    """
    if hf.get("apply_residual_connection_post_layernorm"):
        raise ConfigError(f"{source}: field 'apply_residual_connection_post_layernorm': true is unsupported")
    new_decoder = bool(hf.get("new_decoder_architecture", False)) or hf.get("model_type") == "RefinedWeb"
    heads = hf.get("num_attention_heads") or hf.get("n_head") or 71
    hidden = hf.get("hidden_size") or hf.get("n_embed") or 4544
    parallel = True if new_decoder else bool(hf.get("parallel_attn", True))
    theta, scaling = _rope(hf, source)
    data = dict(
        dtype=dtype,
        vocab_size=hf.get("vocab_size", 65024),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        hidden_size=hidden,
        num_hidden_layers=hf.get("num_hidden_layers") or hf.get("n_layer") or 32,
        num_attention_heads=heads,
        num_key_value_heads=_kv_heads(hf, heads, new_decoder),
        hidden_act=hf.get("activation", "gelu"),
        intermediate_size=hf.get("ffn_hidden_size") or 4 * hidden,
        norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        position_embedding_type="alibi_with_scale" if hf.get("alibi", False) else "rope_gpt_neox",
        bias=hf.get("bias", False),
        new_decoder_architecture=new_decoder,
        parallel_attention=parallel,
        num_ln_in_parallel_attn=(hf.get("num_ln_in_parallel_attn") or 2) if new_decoder else 1,
        rotary_base=theta,
        rotary_scaling=scaling,
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        mapping=mapping.model_dump(),
    )
    return validate_config(FalconConfig, data, source)
