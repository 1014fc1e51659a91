"""The checkpoint config schema: every field and default of the TensorRT-LLM table."""

from __future__ import annotations

import pytest

from bestiary.core.format.config import Mapping, PretrainedConfig, QuantConfig, validate_config
from bestiary.core.format.errors import ConfigError

MINIMAL = dict(architecture="LlamaForCausalLM", dtype="float16", vocab_size=100, hidden_size=64,
               num_hidden_layers=2, num_attention_heads=4, hidden_act="silu")


def test_defaults_of_the_spec_table():
    c = PretrainedConfig(**MINIMAL)
    assert c.logits_dtype == "float32"
    assert c.max_position_embeddings is None and c.intermediate_size is None
    assert c.num_key_value_heads == 4 and c.head_size == 16
    assert c.norm_epsilon == 1e-5
    assert c.position_embedding_type == "learned_absolute"
    assert c.mapping == Mapping(world_size=1, tp_size=1, pp_size=1)
    q = c.quantization
    assert (q.quant_algo, q.kv_cache_quant_algo, q.group_size, q.has_zero_point, q.pre_quant_scale,
            q.exclude_modules) == (None, None, 64, False, False, None)


def test_json_has_every_field():
    data = PretrainedConfig(**MINIMAL).to_json_dict()
    assert set(QuantConfig.model_fields) == set(data["quantization"])
    assert set(Mapping.model_fields) == set(data["mapping"])
    assert set(PretrainedConfig.model_fields) == set(data)


def test_mapping_world_size_derived_and_checked():
    assert Mapping(tp_size=2, pp_size=3).world_size == 6
    with pytest.raises(ValueError):
        Mapping(world_size=4, tp_size=2, pp_size=1)


@pytest.mark.parametrize("field,value,word", [
    ("dtype", "float8", "dtype"),
    ("num_attention_heads", 0, "num_attention_heads"),
    ("quantization", {"quant_algo": "W3A16"}, "quantization.quant_algo"),
    ("typo_field", 1, "typo_field"),
])
def test_validation_error_names_field_and_file(field, value, word):
    with pytest.raises(ConfigError, match=rf"ckpt/config.json: field '{word}'"):
        validate_config(PretrainedConfig, {**MINIMAL, field: value}, "ckpt/config.json")


def test_architectures_extend_by_subclassing():
    from bestiary.models.llama.model import LlamaConfig

    c = LlamaConfig(**{**MINIMAL, "rotary_base": 5e5})
    assert c.rotary_base == 5e5 and c.position_embedding_type == "rope_gpt_neox"
    assert "rotary_base" in c.to_json_dict()
