"""ChatGLM's config.json fields (v1 and v2/3) and how they are read from HF configs.

HF readers use the defaults of the config class that wrote the file: THUDM's remote
`configuration_chatglm.py` (v1: chatglm-6b, v2/3: chatglm2-6b / chatglm3-6b) and
transformers' `GlmConfig` (model_type "glm").
"""

from __future__ import annotations

from typing import Literal

from bestiary.core.format.config import Mapping, PretrainedConfig, validate_config
from bestiary.core.format.errors import ConfigError
from pydantic import Field, model_validator

V1_NAME = "ChatGLMForCausalLM"
V2_NAME = "ChatGLM2ForCausalLM"


class ChatGLMConfig(PretrainedConfig):
    """ChatGLM v1 (chatglm-6b): post-LN-style scaled residuals, GELU, 2D rotary, prefix-LM mask."""

    architecture: Literal["ChatGLMForCausalLM"] = V1_NAME
    hidden_act: str = "gelu_new"
    position_embedding_type: Literal["chatglm"] = "chatglm"
    rotary_base: float = Field(10000.0, description="RoPE base of both halves of the 2D rotary.")
    bos_token_id: int = Field(
        150004, description="Token that ends the bidirectional context; the generated span starts with it."
    )
    mask_token_id: int = Field(
        150000, description="[MASK]: the span position when no [gMASK] is in the context."
    )
    gmask_token_id: int = Field(150001, description="[gMASK]: the generated span takes its position.")


class ChatGLM2Config(PretrainedConfig):
    """ChatGLM2/3 and GLM-4 (HF `glm`): RMSNorm, SwiGLU, GQA, interleaved rotary on part of each head."""

    architecture: Literal["ChatGLM2ForCausalLM"] = V2_NAME
    hidden_act: str = "silu"
    position_embedding_type: Literal["rope_gptj"] = "rope_gptj"
    rotary_base: float = Field(10000.0, description="RoPE base (THUDM 10000 * rope_ratio, HF rope_theta).")
    rotary_pct: float = Field(
        0.5, gt=0.0, le=1.0, description="Fraction of head dims rotated (partial_rotary_factor)."
    )
    qkv_bias: bool = Field(True, description="Bias on the fused qkv projection.")
    linear_bias: bool = Field(
        False, description="Bias on attention dense and the MLP (THUDM add_bias_linear)."
    )
    multi_query_attention: bool = Field(
        True,
        description="THUDM layout of a fused query_key_value source: [Q; K; V] (true) or [q, k, v] per head "
        "(false, which also means num_key_value_heads == num_attention_heads).",
    )
    tie_word_embeddings: bool = Field(False, description="lm_head shares the input embedding.")

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head: head_size * rotary_pct."""
        return int(self.head_size * self.rotary_pct)

    @model_validator(mode="after")
    def _check_rotary(self) -> ChatGLM2Config:
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(
                f"head_size {self.head_size} * rotary_pct {self.rotary_pct} must be a positive even number"
            )
        if not self.multi_query_attention and self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("multi_query_attention false needs num_key_value_heads == num_attention_heads")
        return self


def _refuse(hf: dict, source: str, field: str, supported, why: str) -> None:
    """ConfigError when HF field `field` is set to something other than `supported`."""
    value = hf.get(field, supported)
    if value != supported:
        raise ConfigError(f"{source}: field '{field}' = {value!r} is not supported ({why})")


def _refuse_thudm_extras(hf: dict, source: str) -> None:
    """THUDM options with no bestiary counterpart: quantized checkpoints and P-tuning prefixes."""
    _refuse(hf, source, "quantization_bit", 0, "convert the unquantized checkpoint")
    _refuse(hf, source, "pre_seq_len", None, "P-tuning v2 prefix encoders are not supported")


def from_hf_config_v1(hf: dict, dtype: str, mapping: Mapping, source: str = "config.json") -> ChatGLMConfig:
    """ChatGLMConfig from a THUDM chatglm-6b config.json (its class defaults where a field is absent)."""
    _refuse_thudm_extras(hf, source)
    _refuse(hf, source, "position_encoding_2d", True, "ChatGLM v1 is supported with 2D positions only")
    hidden = hf.get("hidden_size", 4096)
    data = {
        "dtype": dtype,
        "vocab_size": hf.get("vocab_size", 150528),
        "max_position_embeddings": hf.get("max_sequence_length", 2048),
        "hidden_size": hidden,
        "num_hidden_layers": hf.get("num_layers", 28),
        "num_attention_heads": hf.get("num_attention_heads", 32),
        "intermediate_size": hf.get("inner_hidden_size", 16384),
        "norm_epsilon": hf.get("layernorm_epsilon", 1e-5),
        "bos_token_id": hf.get("bos_token_id", 150004),
        "mask_token_id": hf.get("mask_token_id", 150000),
        "gmask_token_id": hf.get("gmask_token_id", 150001),
        "mapping": mapping.model_dump(),
    }
    return validate_config(ChatGLMConfig, data, source)


def _thudm_v2(hf: dict, source: str) -> dict:
    """Fields of a THUDM chatglm2/3 config.json (model_type "chatglm")."""
    _refuse_thudm_extras(hf, source)
    _refuse(hf, source, "rmsnorm", True, "only RMSNorm ChatGLM2/3 models are supported")
    _refuse(hf, source, "post_layer_norm", True, "a final layer norm is expected")
    _refuse(hf, source, "apply_residual_connection_post_layernorm", False, "pre-norm residuals only")
    heads = hf.get("num_attention_heads", 32)
    mqa = bool(hf.get("multi_query_attention", False))
    add_bias_linear = bool(hf.get("add_bias_linear", False))
    return {
        "vocab_size": hf.get("padded_vocab_size", 65024),
        "max_position_embeddings": hf.get("seq_length", 2048),
        "hidden_size": hf.get("hidden_size", 4096),
        "num_hidden_layers": hf.get("num_layers", 28),
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("multi_query_group_num", 1) if mqa else heads,
        "head_size": hf.get("kv_channels", 128),
        "intermediate_size": hf.get("ffn_hidden_size", 13696),
        "norm_epsilon": hf.get("layernorm_epsilon", 1e-5),
        "rotary_base": 10000.0 * float(hf.get("rope_ratio", 1)),
        "rotary_pct": 0.5,
        "qkv_bias": add_bias_linear or bool(hf.get("add_qkv_bias", False)),
        "linear_bias": add_bias_linear,
        "multi_query_attention": mqa,
        "tie_word_embeddings": False,  # THUDM's output_layer is never tied to the embedding
    }


def _hf_glm(hf: dict, source: str) -> dict:
    """Fields of a transformers GlmConfig dict (model_type "glm")."""
    heads = hf.get("num_attention_heads", 32)
    hidden = hf.get("hidden_size", 4096)
    head_dim = hf.get("head_dim", 128)  # absent: GlmConfig's 128; null: hidden / heads
    rope = hf.get("rope_parameters") or {}
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise ConfigError(
            f"{source}: field 'rope_parameters.rope_type' = {kind!r} is not supported (default only)"
        )
    return {
        "vocab_size": hf.get("vocab_size", 151552),
        "max_position_embeddings": hf.get("max_position_embeddings", 131072),
        "hidden_size": hidden,
        "num_hidden_layers": hf.get("num_hidden_layers", 40),
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads", 2) or heads,
        "head_size": head_dim or hidden // heads,
        "hidden_act": hf.get("hidden_act", "silu"),
        "intermediate_size": hf.get("intermediate_size", 13696),
        "norm_epsilon": hf.get("rms_norm_eps", 1.5625e-07),
        "rotary_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "rotary_pct": float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))),
        "qkv_bias": bool(hf.get("attention_bias", True)),
        "linear_bias": False,
        "multi_query_attention": True,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def from_hf_config_v2(hf: dict, dtype: str, mapping: Mapping, source: str = "config.json") -> ChatGLM2Config:
    """ChatGLM2Config from a THUDM chatglm2/3 config.json or a transformers `glm` one."""
    fields = _hf_glm(hf, source) if hf.get("model_type") == "glm" else _thudm_v2(hf, source)
    return validate_config(ChatGLM2Config, dict(dtype=dtype, mapping=mapping.model_dump(), **fields), source)
