"""The families' HF config readers on hostile fields: a null means the HF default, a malformed
`architectures` claims nothing, and every family x key x wrong value ends as a config or a one-line
ConfigError, never another exception (issue 46, item 6: `"architectures": true` was a TypeError in
ChatGLM's claim hook)."""

from __future__ import annotations

import pytest

from bestiary.core.convert.source_to_checkpoint import resolve
from bestiary.core.format.config import Mapping
from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.hf_fields import check_hf_fields
from bestiary.models.chatglm import _is_thudm_chatglm, bestiary_claim_hf_config
from bestiary.registry import default_registry

BASE = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 32,
        "max_position_embeddings": 64}
FAMILIES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "chatglm1": {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "position_encoding_2d": True},
    "chatglm2": {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "multi_query_group_num": 2,
                 "multi_query_attention": True},
    "glm": {"architectures": ["GlmForCausalLM"], "model_type": "glm", "head_dim": 4, "num_key_value_heads": 2},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
              "sliding_window": 8},
    "qwen": {"architectures": ["QWenLMHeadModel"], "model_type": "qwen", "seq_length": 32},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
    "opt": {"architectures": ["OPTForCausalLM"], "model_type": "opt", "ffn_dim": 32},
    "falcon": {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "new_decoder_architecture": True,
               "num_kv_heads": 2},
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_positions": 64},
    "baichuan": {"architectures": ["BaichuanForCausalLM"], "model_type": "baichuan"},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2, "num_key_value_heads": 2},
    "exaone4": {"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "sliding_window": 8,
                "sliding_window_pattern": 2},
}
KEYS = ("architectures", "rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings", "head_dim",
        "num_key_value_heads", "sliding_window", "sliding_window_pattern", "max_window_layers", "layer_types",
        "attention_bias", "tie_word_embeddings", "multi_query_group_num", "rope_ratio", "inner_hidden_size",
        "padded_vocab_size", "moe_intermediate_size", "num_experts", "no_bias", "use_dynamic_ntk", "multi_query",
        "num_ln_in_parallel_attn", "enable_bias", "_remove_final_layer_norm", "norm_head", "word_embed_proj_dim",
        "mask_token_id", "num_hidden_layers", "hidden_act", "rms_norm_eps")
HOSTILE = (True, None, -1, 0, 1e308, float("nan"), 10**30, "12", [1], {}, {"type": 1}, [[[[]]]])


def read(hf: dict):
    """What `bestiary convert` does with an HF config before any weight: check, claim, read."""
    check_hf_fields(hf, "c/config.json")
    spec = default_registry().for_hf_config(hf, "c", None)
    return resolve(spec.from_hf_config)(hf, "float32", Mapping(), source="c/config.json")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_key_and_wrong_value_is_a_config_or_one_line(family):
    read(BASE | FAMILIES[family])  # the base config of the family reads
    for key in KEYS:
        for value in HOSTILE:
            try:
                read(BASE | FAMILIES[family] | {key: value})
            except BestiaryError as err:
                assert "\n" not in str(err), (key, value, str(err))


def test_a_malformed_architectures_claims_nothing():
    assert not _is_thudm_chatglm({"architectures": True})
    assert not _is_thudm_chatglm({"architectures": "ChatGLMModel"})  # a string is not a list of names
    assert bestiary_claim_hf_config(hf_config={"architectures": [["ChatGLMModel"]]}) is None
    assert _is_thudm_chatglm({"architectures": ["ChatGLMModel", 7]})


@pytest.mark.parametrize(("family", "key", "field", "expected"), [
    ("qwen2_moe", "moe_intermediate_size", "intermediate_size", 1408),
    ("qwen2_moe", "num_experts", "num_local_experts", 60),
    ("qwen2_moe", "qkv_bias", "qkv_bias", True),
    ("opt", "enable_bias", "qkv_bias", True),
    ("opt", "_remove_final_layer_norm", "remove_final_layer_norm", False),
    ("falcon", "new_decoder_architecture", "num_key_value_heads", 1),  # classic layout, multi_query default
    ("qwen", "no_bias", "dense_bias", False),
    ("chatglm2", "rope_ratio", "rotary_base", 10000.0),
    ("chatglm1", "inner_hidden_size", "intermediate_size", 16384),
    ("exaone4", "sliding_window_pattern", "layer_types", ["sliding_attention"] * 2),  # pattern 4: both local
])
def test_a_null_field_takes_the_hf_default(family, key, field, expected):
    """transformers' config classes turn null into the default; `hf.get(key, default)` gave None."""
    assert getattr(read(BASE | FAMILIES[family] | {key: None}), field) == expected
