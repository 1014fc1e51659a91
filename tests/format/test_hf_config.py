"""core.format.hf_config: what a family's `hf_config_reader` reads, including the traps an outside
contributor hit (defaults of the rope fields ignored, same-named HF fields silently dropped)."""

from __future__ import annotations

from typing import Literal

import pytest

from bestiary.core.format.config import Mapping
from bestiary.core.format.errors import ConfigError
from bestiary.core.format.hf_config import DecoderConfig, hf_config_reader, read_rope

SIZES = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}


class NeoxLike(DecoderConfig):
    architecture: Literal["NeoxLike"] = "NeoxLike"
    use_parallel_residual: bool = False
    rotary_emb_base: float | None = None


def test_rope_defaults_apply_like_the_others():
    read = hf_config_reader(NeoxLike, defaults={"rotary_pct": 0.25, "rotary_base": 500.0, "norm_epsilon": 1e-5})
    config = read(SIZES, "float32", Mapping())
    assert (config.rotary_pct, config.rotary_base, config.norm_epsilon) == (0.25, 500.0, 1e-5)
    assert read(SIZES | {"partial_rotary_factor": 0.5}, "float32", Mapping()).rotary_pct == 0.5


def test_a_same_named_hf_field_is_copied_unless_told_otherwise():
    hf = SIZES | {"use_parallel_residual": True}
    assert hf_config_reader(NeoxLike)(hf, "float32", Mapping()).use_parallel_residual is True
    assert hf_config_reader(NeoxLike)(SIZES, "float32", Mapping()).use_parallel_residual is False  # absent
    assert hf_config_reader(NeoxLike)(hf | {"use_parallel_residual": None}, "float32",
                                      Mapping()).use_parallel_residual is False  # null: the class default
    assert hf_config_reader(NeoxLike, copy_same_named=False)(hf, "float32", Mapping()).use_parallel_residual is False
    skip = hf_config_reader(NeoxLike, copy_same_named=("use_parallel_residual",))
    assert skip(hf, "float32", Mapping()).use_parallel_residual is False
    lam = hf_config_reader(NeoxLike, use_parallel_residual=lambda hf: not hf["use_parallel_residual"])
    assert lam(hf, "float32", Mapping()).use_parallel_residual is False  # explicit fields win


def test_structural_and_common_fields_are_not_copied_by_name():
    """HF's own `dtype` / `tie_word_embeddings` / ... go through their readers, never the name copy."""
    hf = SIZES | {"dtype": "bfloat16", "architecture": "Other", "rotary_base": 5.0}
    config = hf_config_reader(NeoxLike)(hf, "float32", Mapping())
    assert (config.dtype, config.architecture, config.rotary_base) == ("float32", "NeoxLike", 10000.0)


def test_rope_kinds_refuse_other_scalings_naming_the_source():
    read = hf_config_reader(NeoxLike, rope_kinds=("linear",))
    assert read(SIZES | {"rope_scaling": {"type": "linear", "factor": 2.0}}, "float32", Mapping()).rotary_scaling
    with pytest.raises(ConfigError, match=r"/m/config.json: field 'rope_scaling': rope_type 'yarn' is not supported "
                                          r"\(default, linear\)"):
        read(SIZES | {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "float32", Mapping(), "/m/config.json")


def test_read_rope_reads_either_transformers_layout():
    four = {"rope_theta": 1e6, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "partial_rotary_factor": 0.5}
    five = {"rope_parameters": {"rope_theta": 1e6, "rope_type": "llama3", "factor": 8.0, "partial_rotary_factor": 0.5}}
    assert read_rope(four) == read_rope(five) == {
        "rotary_base": 1e6, "rotary_scaling": {"rope_type": "llama3", "factor": 8.0}, "rotary_pct": 0.5}


class AllBiases(DecoderConfig):
    architecture: Literal["AllBiases"] = "AllBiases"
    qkv_bias: bool = True
    dense_bias: bool = True
    mlp_bias: bool = True


def test_bias_fields_come_from_the_source_only_when_it_sets_them():
    """No attention_bias / mlp_bias in the source: the class's own bias defaults stand (GPT-2, BLOOM)."""
    read = hf_config_reader(AllBiases)
    config = read(SIZES, "float32", Mapping())
    assert (config.qkv_bias, config.dense_bias, config.mlp_bias) == (True, True, True)
    config = read(SIZES | {"attention_bias": False, "mlp_bias": False}, "float32", Mapping())
    assert (config.qkv_bias, config.dense_bias, config.mlp_bias) == (False, False, False)
