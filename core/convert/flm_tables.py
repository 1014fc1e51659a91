"""What `bestiary export --format flm` needs per architecture: its HF config back, and the inverse of
each postprocess hook (canonical fused rows -> the HF tensors they were made from).

A *bundle* is the tensors of one canonical key that share its rows: {"value"} for a plain
tensor, {"weight", "weights_scaling_factor"[, "zeros"]} for a quantized linear; every row
operation applies to all of them alike (rows are independent in every layout).
An inverse returns [(source key, bundle, index, total)]: `total` > 1 when several canonical keys
fill one source tensor (ChatGLM2's gate and up halves of dense_h_to_4h, concatenated in index order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bestiary.core.format.errors import BestiaryError

Bundle = dict[str, torch.Tensor]
Parts = list[tuple[str, Bundle, int, int]]

# architecture -> (constant HF fields, HF field -> canonical config attribute or function of the config)
HF_CONFIGS: dict[str, tuple[dict, dict[str, str | Callable]]] = {
    "LlamaForCausalLM": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
        {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
         "num_hidden_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
         "num_key_value_heads": "num_key_value_heads", "head_dim": "head_size", "hidden_act": "hidden_act",
         "rms_norm_eps": "norm_epsilon", "rope_theta": "rotary_base", "rope_scaling": "rotary_scaling",
         "max_position_embeddings": "max_position_embeddings", "attention_bias": "qkv_bias",
         "mlp_bias": "mlp_bias", "tie_word_embeddings": "tie_word_embeddings", "torch_dtype": "dtype"},
    ),
    "ChatGLMForCausalLM": (
        {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "position_encoding_2d": True},
        {"vocab_size": "vocab_size", "max_sequence_length": "max_position_embeddings",
         "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
         "num_attention_heads": "num_attention_heads", "inner_hidden_size": "intermediate_size",
         "layernorm_epsilon": "norm_epsilon", "bos_token_id": "bos_token_id", "mask_token_id": "mask_token_id",
         "gmask_token_id": "gmask_token_id", "torch_dtype": "dtype"},
    ),
    "ChatGLM2ForCausalLM": (
        {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "rmsnorm": True, "post_layer_norm": True,
         "apply_residual_connection_post_layernorm": False},
        {"padded_vocab_size": "vocab_size", "seq_length": "max_position_embeddings", "hidden_size": "hidden_size",
         "num_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
         "multi_query_attention": "multi_query_attention", "multi_query_group_num": "num_key_value_heads",
         "kv_channels": "head_size", "ffn_hidden_size": "intermediate_size", "layernorm_epsilon": "norm_epsilon",
         "rope_ratio": lambda c: c.rotary_base / 10000.0, "add_bias_linear": "dense_bias",
         "add_qkv_bias": "qkv_bias", "torch_dtype": "dtype"},
    ),
}


def hf_config_of(config) -> dict:
    """The HF config dict a .flm's model info carries for `config` (refused for an unknown architecture)."""
    table = HF_CONFIGS.get(config.architecture)
    if table is None:
        raise BestiaryError(f"{config.architecture}: .flm export knows {', '.join(sorted(HF_CONFIGS))}")
    if config.architecture == "ChatGLM2ForCausalLM" and (config.rotary_pct != 0.5 or config.tie_word_embeddings):
        raise BestiaryError("ChatGLM2ForCausalLM: only THUDM's layout (rotary_pct 0.5, untied output layer) "
                            "can be exported to .flm")
    constant, fields = table
    out = dict(constant)
    for hf_key, source in fields.items():
        value = source(config) if callable(source) else getattr(config, source)
        if value is not None:
            out[hf_key] = value
    return out


# ---- inverse postprocess hooks -------------------------------------------------------------------


def _rows(bundle: Bundle, fn: Callable[[torch.Tensor], torch.Tensor]) -> Bundle:
    return {name: fn(t) for name, t in bundle.items()}


def interleave_heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """[Q; K; V] -> [q_0 k_0 v_0 q_1 ...] along dim 0 (inverse of chatglm's deinterleave_heads)."""
    heads = t.shape[0] // (3 * head_size)
    return t.reshape(3, heads, head_size, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _split(bundle: Bundle, sizes: list[int]) -> list[Bundle]:
    parts: list[Bundle] = [{} for _ in sizes]
    for name, t in bundle.items():
        for part, piece in zip(parts, torch.split(t, sizes, dim=0)):
            part[name] = piece.contiguous()
    return parts


def identity(key: str, bundle: Bundle, sources: list[str], config) -> Parts:
    if len(sources) != 1:
        raise BestiaryError(f"{key}: {len(sources)} source tensors and no inverse hook")
    return [(sources[0], bundle, 0, 1)]


def split_qkv(key: str, bundle: Bundle, sources: list[str], config) -> Parts:
    """[Q; K; V] rows -> q, k, v (H D, KVH D, KVH D rows)."""
    if len(sources) == 1:
        return identity(key, bundle, sources, config)
    d = config.head_size
    sizes = [config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d]
    return [(s, part, 0, 1) for s, part in zip(sources, _split(bundle, sizes))]


def per_head_qkv(key: str, bundle: Bundle, sources: list[str], config) -> Parts:
    """ChatGLM v1 query_key_value: [Q; K; V] -> per-head [q_h k_h v_h]."""
    return [(sources[0], _rows(bundle, lambda t: interleave_heads(t, config.head_size)), 0, 1)]


def qkv_v2(key: str, bundle: Bundle, sources: list[str], config) -> Parts:
    """ChatGLM2 query_key_value: [Q; K; V] as is (multi_query_attention), else per head."""
    if len(sources) == 3:
        return split_qkv(key, bundle, sources, config)
    if config.multi_query_attention:
        return identity(key, bundle, sources, config)
    return per_head_qkv(key, bundle, sources, config)


def first_half(key: str, bundle: Bundle, sources: list[str], config) -> Parts:
    return [(sources[0], bundle, 0, 2)]


def second_half(key: str, bundle: Bundle, sources: list[str], config) -> Parts:
    return [(sources[0], bundle, 1, 2)]


INVERSE_HOOKS: dict[str, Callable[[str, Bundle, list[str], object], Parts]] = {
    "identity": identity,
    "bestiary.core.convert.postprocess:identity": identity,
    "bestiary.core.convert.postprocess:concat_dim0": split_qkv,
    "bestiary.models.chatglm.weights:qkv_per_head": per_head_qkv,
    "bestiary.models.chatglm.weights:qkv_v2": qkv_v2,
    "bestiary.models.chatglm.weights:gate_half": first_half,
    "bestiary.models.chatglm.weights:up_half": second_half,
}
