"""core.format.hf_fields: an HF config.json field of the wrong type or range is one ConfigError line
naming the file and the key, before any family's reader does arithmetic with it (issue 46, items 6
and 8: `"architectures": true`, `"rope_scaling": -1` / `1e308`, `"rope_parameters": -1` were internal
errors; `"max_position_embeddings": true` was taken as 1)."""

from __future__ import annotations

import json
import math

import pytest
from cli_errors import one_line

from bestiary.core.format.config import Mapping
from bestiary.core.format.errors import ConfigError
from bestiary.core.format.hf_config import hf_config_reader, read_rope, refuse_unsupported
from bestiary.core.format.hf_fields import check_hf_fields, is_number
from bestiary.core.sources import open_source
from bestiary.models.llama.model import LlamaConfig

SIZES = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("architectures", True, "a list of strings"),
    ("architectures", "LlamaForCausalLM", "a list of strings"),
    ("architectures", [["LlamaForCausalLM"]], "a list of strings"),
    ("rope_scaling", -1, "a JSON object or null"),
    ("rope_scaling", 1e308, "a JSON object or null"),
    ("rope_parameters", -1, "a JSON object or null"),
    ("max_position_embeddings", True, "an integer in 1..2147483647"),
    ("max_position_embeddings", 2048.0, "an integer"),
    ("hidden_size", "64", "an integer"),
    ("num_attention_heads", 0, "an integer in 1.."),
    ("num_hidden_layers", 10**12, "an integer in 1..1024"),
    ("sliding_window", -1, "an integer in 0.."),
    ("rope_theta", float("nan"), "a finite number > 0"),
    ("rope_theta", 10**400, "a finite number > 0"),
    ("rms_norm_eps", float("inf"), "a finite number >= 0"),
    ("partial_rotary_factor", 1.5, "<= 1"),
    ("tie_word_embeddings", "false", "true or false"),
    ("attention_bias", 1, "true or false"),
    ("model_type", ["llama"], "a string"),
    ("hidden_act", None, None),  # null: the default, never an error
    ("quantization_config", "awq", "a JSON object"),
    ("layer_types", [1, 2], "a list of strings"),
    ("sliding_window_pattern", -1, "0..1024 or a pattern string"),
    ("sliding_window_pattern", "", "0..1024 or a pattern string"),
])
def test_a_wrong_field_is_one_line_naming_file_and_key(key, value, expected):
    if expected is None:
        check_hf_fields(SIZES | {key: value}, "/m/config.json")
        return
    with pytest.raises(ConfigError) as err:
        check_hf_fields(SIZES | {key: value}, "/m/config.json")
    message = str(err.value)
    assert message.startswith(f"/m/config.json: field {key!r}: expected ") and expected in message, message
    assert "\n" not in message


@pytest.mark.parametrize(("rope", "words"), [
    ({"rope_type": 7}, "rope_scaling.rope_type"),
    ({"type": "linear"}, "needs factor"),
    ({"type": "linear", "factor": 0}, "rope_scaling.factor"),
    ({"type": "linear", "factor": "2"}, "rope_scaling.factor"),
    ({"type": "linear", "factor": float("inf")}, "rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor, high_freq_factor"),
    (LLAMA3 | {"low_freq_factor": 4.0}, "low_freq_factor < high_freq_factor"),
    (LLAMA3 | {"original_max_position_embeddings": True}, "rope_scaling.original_max_position_embeddings"),
    ({"rope_type": "longrope", "short_factor": [1.0, None]}, "rope_scaling.short_factor"),
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": "32"}, "rope_scaling.beta_fast"),
])
def test_rope_dicts_are_checked_member_by_member(rope, words):
    with pytest.raises(ConfigError, match="^/m/config.json: field ") as err:
        check_hf_fields(SIZES | {"rope_scaling": rope}, "/m/config.json")
    assert words in str(err.value), err.value
    with pytest.raises(ConfigError):  # the same rules for transformers 5's rope_parameters
        check_hf_fields(SIZES | {"rope_parameters": rope}, "/m/config.json")
    if "needs" not in words and "<" not in words:  # read_rope checks the types (the reader, completeness too)
        with pytest.raises(ConfigError, match="^/m/config.json: field 'rope_parameters"):
            read_rope(SIZES | {"rope_parameters": rope}, source="/m/config.json")


def test_real_rope_dicts_pass():
    for rope in (LLAMA3, {"type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0,
                 "original_max_position_embeddings": 32768}, {"rope_type": "default", "rope_theta": 1e6}):
        check_hf_fields(SIZES | {"rope_scaling": rope, "rope_parameters": rope}, "c")


def test_is_number_refuses_what_float_cannot_hold():
    assert is_number(1) and is_number(0.5) and not is_number(True) and not is_number(float("nan"))
    assert not is_number(10**400) and not is_number("1") and not is_number(None)


def test_the_reader_refuses_a_rope_kind_the_runtime_cannot_compute():
    """Default rope_kinds: linear, llama3 and yarn (core.layers.rotary); dynamic converted, then failed at run."""
    read = hf_config_reader(LlamaConfig)
    assert read(SIZES | {"rope_scaling": LLAMA3}, "float32", Mapping()).rotary_scaling["rope_type"] == "llama3"
    yarn = {"rope_type": "yarn", "factor": 2.0}
    assert read(SIZES | {"rope_scaling": yarn}, "float32", Mapping()).rotary_scaling == yarn
    with pytest.raises(ConfigError, match=r"^c/config.json: field 'rope_scaling': rope_type 'dynamic' is not supp"):
        read(SIZES | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "float32", Mapping(), "c/config.json")


def test_a_family_field_that_cannot_be_derived_is_a_config_error():
    read = hf_config_reader(LlamaConfig, intermediate_size=lambda hf: hf["ffn"] // hf["split"])
    with pytest.raises(ConfigError, match=r"^c/config.json: cannot derive field 'intermediate_size' .*ZeroDivision"):
        read(SIZES | {"ffn": 8, "split": 0}, "float32", Mapping(), "c/config.json")


def test_an_unsupported_value_must_match_in_type_too():
    """0 == False in Python; `"use_sliding_window": 0` is still not the boolean the family runs."""
    refuse_unsupported({"use_sliding_window": False}, {"use_sliding_window": False}, "c")
    with pytest.raises(ConfigError, match="'use_sliding_window' = 0 is not supported"):
        refuse_unsupported({"use_sliding_window": 0}, {"use_sliding_window": False}, "c")


def test_huge_values_are_cut_in_the_message():
    with pytest.raises(ConfigError) as err:
        check_hf_fields(SIZES | {"architectures": "x" * 2**20}, "c")
    assert len(str(err.value)) < 200 and "str of" in str(err.value)


def _hf_dir(tmp_path, **fields):
    directory = tmp_path / "hf"
    directory.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SIZES, **fields}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(("key", "value"), [("architectures", True), ("rope_scaling", -1), ("rope_scaling", 1e308),
                                            ("rope_parameters", -1), ("max_position_embeddings", True),
                                            ("rope_theta", math.inf)])
def test_open_source_names_the_config_json(tmp_path, key, value):
    """Checked where config.json is read: before the claim hooks (ChatGLM's iterated `architectures`)."""
    directory = _hf_dir(tmp_path, **{key: value})
    with pytest.raises(ConfigError, match=f"^{directory / 'config.json'}: field {key!r}: expected "):
        open_source(directory)


@pytest.mark.parametrize(("key", "value"), [("architectures", True), ("rope_scaling", -1),
                                            ("max_position_embeddings", True)])
def test_convert_exits_2_with_one_line(tmp_path, capsys, key, value):
    directory = _hf_dir(tmp_path, **{key: value})
    one_line(capsys, ["convert", "--model_dir", str(directory), "--output_dir", str(tmp_path / "out")], 2,
             "config.json", key)
    assert not (tmp_path / "out").exists()
