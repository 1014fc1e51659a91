"""Hostile values in the tables a source carries besides its weights: GGUF metadata and tokenizer
tables, .flm model info. Each is one BestiaryError line naming the file and the key, and a GGUF
with a corrupt tensor offset says so without numpy's RuntimeWarnings first (issue 46, items 6, 7)."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from cli_errors import one_line
from gguf import GGUFValueType as T
from test_flm_format import INFO, golden_file

from bestiary.core.format.errors import BestiaryError, ConfigError
from bestiary.core.sources import open_source
from bestiary.core.sources.flm_source import hf_config_from_info, parse_value
from bestiary.core.sources.gguf_source import open_gguf

H, NH, NKV, FFN, LAYERS = 64, 4, 2, 80, 2
TOKENS = ["<|endoftext|>", "a", "b", "ab", "c"] + [f"t{i}" for i in range(91)]


def write_gguf(path: Path, **metadata: tuple) -> Path:
    """A 2-layer llama GGUF (random float32 weights) with a gpt2 BPE tokenizer; `metadata` replaces keys
    ("llama_block_count" for llama.block_count: dots as underscores) with (value, GGUF type)."""
    meta = {"llama.context_length": (128, T.UINT32), "llama.embedding_length": (H, T.UINT32),
            "llama.block_count": (LAYERS, T.UINT32), "llama.feed_forward_length": (FFN, T.UINT32),
            "llama.attention.head_count": (NH, T.UINT32), "llama.attention.head_count_kv": (NKV, T.UINT32),
            "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32), "tokenizer.ggml.model": ("gpt2", T.STRING),
            "tokenizer.ggml.tokens": (TOKENS, T.ARRAY), "tokenizer.ggml.merges": (["a b"], T.ARRAY),
            "tokenizer.ggml.token_type": ([3] + [1] * (len(TOKENS) - 1), T.ARRAY),
            "tokenizer.ggml.bos_token_id": (0, T.UINT32), "tokenizer.ggml.eos_token_id": (0, T.UINT32)}
    meta |= {key.replace("_", ".", 1) if key.startswith(("llama_", "tokenizer_")) else key: v
             for key, v in metadata.items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind) in meta.items():
        writer.add_array(key, value) if kind == T.ARRAY else writer.add_key_value(key, value, kind)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(TOKENS), H), "output_norm.weight": (H,), "output.weight": (len(TOKENS), H)}
    for n in range(LAYERS):
        shapes |= {f"blk.{n}.{name}.weight": shape for name, shape in (
            ("attn_norm", (H,)), ("ffn_norm", (H,)), ("attn_q", (H, H)), ("attn_k", (NKV * 16, H)),
            ("attn_v", (NKV * 16, H)), ("attn_output", (H, H)), ("ffn_gate", (FFN, H)), ("ffn_up", (FFN, H)),
            ("ffn_down", (H, FFN)))}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tiny_gguf_opens(tmp_path):
    assert open_gguf(write_gguf(tmp_path / "m.gguf")).hf_config["hidden_size"] == H


@pytest.mark.parametrize(("merges", "missing"), [(["a zz"], "zz"), (["a"], ""), (["b c"], "bc")])
def test_a_merge_naming_a_missing_token_is_one_line(tmp_path, merges, missing):
    """A merge's two tokens and their concatenation must be tokens (tokenizers' BPE init error before)."""
    path = write_gguf(tmp_path / "m.gguf", **{"tokenizer.ggml.merges": (merges, T.ARRAY)})
    with pytest.raises(BestiaryError, match=rf"tokenizer.ggml.merges\[0\] .*token {missing!r} is not in"):
        open_gguf(path)


@pytest.mark.parametrize(("key", "value"), [
    ("tokenizer.ggml.tokens", ([1, 2, 3], T.ARRAY)),
    ("tokenizer.ggml.model", (7, T.UINT32)),
    ("tokenizer.ggml.pre", ([1], T.ARRAY)),
    ("tokenizer.ggml.bos_token_id", ("x", T.STRING)),
    ("tokenizer.ggml.add_bos_token", (1, T.UINT32)),
    ("tokenizer.ggml.scores", (["x"], T.ARRAY)),
    ("tokenizer.chat_template", (5, T.INT32)),
])
def test_a_tokenizer_table_of_the_wrong_type_is_one_line(tmp_path, key, value):
    path = write_gguf(tmp_path / "m.gguf", **{key: value})
    with pytest.raises(BestiaryError, match=f"GGUF metadata {key!r}: expected ") as err:
        open_gguf(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("key", "value"), [
    ("llama.embedding_length", ("64", T.STRING)), ("llama.attention.head_count", (0, T.UINT32)),
    ("llama.block_count", ([2], T.ARRAY)), ("llama.rope.freq_base", (float("nan"), T.FLOAT32)),
    ("llama.attention.layer_norm_rms_epsilon", (True, T.BOOL)), ("llama.rope.scaling.type", ("linear", T.STRING)),
])
def test_gguf_config_metadata_of_the_wrong_type_is_one_line(tmp_path, key, value):
    """int("64") / hidden // 0 / float(nan) in the config builder were internal errors or NaN configs."""
    path = write_gguf(tmp_path / "m.gguf", **{key: value})
    with pytest.raises(ConfigError, match=r"GGUF metadata key '[a-z_.]+'"):
        open_gguf(path)


def _offset_at(path: Path, name: str) -> int:
    """File position of tensor `name`'s data offset field (its last info part)."""
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return tensor.field.offset + sum(p.nbytes for p in tensor.field.parts[:5])


def test_a_bad_tensor_offset_is_one_line_without_numpy_warnings(tmp_path, capsys):
    """The offset moved onto another tensor's half-precision data: garbage that overflows and NaNs."""
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(str(path))
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    nan = np.full(H, np.nan, dtype=np.float32).tobytes()
    data[int(norm.data_offset):int(norm.data_offset) + len(nan)] = nan  # NaN in the data it now points at
    struct.pack_into("<Q", data, _offset_at(path, "blk.0.ffn_norm.weight"), int(norm.data_offset) - reader.data_offset)
    path.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would be an exception here
        weights = open_gguf(path).weights
        weights.load("model.layers.0.post_attention_layernorm.weight")
    err = one_line(capsys, ["convert", "--model_dir", str(path), "--output_dir", str(tmp_path / "out")], 2,
                   "not finite")
    assert "RuntimeWarning" not in err


def test_dequantizing_garbage_warns_nothing(tmp_path, capsys):
    """Q8_0 blocks whose scale is inf and values 0 (what a corrupt offset reads): gguf.quants' inf * 0
    warned 'invalid value encountered in multiply' before the one-line non-finite error."""
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind) in {"llama.context_length": (128, T.UINT32), "llama.embedding_length": (H, T.UINT32),
                               "llama.block_count": (1, T.UINT32), "llama.feed_forward_length": (FFN, T.UINT32),
                               "llama.attention.head_count": (NH, T.UINT32),
                               "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32),
                               "llama.vocab_size": (32, T.UINT32)}.items():
        writer.add_key_value(key, value, kind)
    blocks = np.array(([0x00, 0x7C] + [0] * 32) * (H // 32) * 32, dtype=np.uint8)  # f16 scale inf, 32 zeros
    writer.add_tensor("token_embd.weight", blocks.reshape(32, H // 32 * 34), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = open_gguf(path).weights.load("model.embed_tokens.weight")
    assert values.shape == (32, H) and values.isnan().all()  # the non-finite check refuses it after, in one line
    assert capsys.readouterr().err == ""


# ---- .flm model info ------------------------------------------------------------------------------


def test_parse_value_keeps_text_python_cannot_evaluate():
    """ast.literal_eval raises TypeError on an unhashable key (an internal error before)."""
    assert parse_value("{[1]: 2}") == "{[1]: 2}"
    assert parse_value("{[1], 2}") == "{[1], 2}"
    assert parse_value("[" * 150 + "]" * 150) is not None
    assert parse_value("{'type': 'linear'}") == {"type": "linear"}


@pytest.mark.parametrize(("key", "text", "words"), [
    ("rope_scaling", "{[1]: 2}", "field 'rope_scaling': expected a JSON object"),
    ("rope_scaling", "[" * 150 + "]" * 150, "field 'rope_scaling': expected a JSON object"),
    ("hidden_size", "True", "field 'hidden_size': expected an integer"),
    ("architectures", "LlamaForCausalLM", "field 'architectures': expected a list of strings"),
    ("tie_word_embeddings", "'False'", "field 'tie_word_embeddings': expected true or false"),
    ("rope_scaling.factor", "-2.0", "field 'rope_scaling.factor': expected a finite number > 0"),
])
def test_flm_model_info_values_are_checked(tmp_path, key, text, words):
    path = golden_file(tmp_path / "g.flm", {**INFO, key: text})
    with pytest.raises(ConfigError) as err:
        open_source(path)
    assert str(err.value).startswith(f"{path} (model info): ") and words in str(err.value), err.value


def test_flm_dotted_rope_keys_win_over_a_plain_value():
    config = hf_config_from_info({"rope_scaling": "5", "rope_scaling.type": "linear", "rope_scaling.factor": "2.0"})
    assert config["rope_scaling"] == {"type": "linear", "factor": 2.0}


@pytest.mark.parametrize(("text", "words"), [("abc", "expected a count of LoRA adapters"),
                                             ("\u00b2", "expected a count"), ("2", "are not supported")])
def test_flm_peft_size_that_is_no_count_is_one_line(tmp_path, text, words):
    """int("abc") was an internal error."""
    path = golden_file(tmp_path / "g.flm", {**INFO, "peft_size": text})
    with pytest.raises(BestiaryError, match=words):
        open_source(path)


@pytest.mark.parametrize("text", ["{", "[1]", "null"])
def test_flm_stored_tokenizer_config_must_be_a_json_object(tmp_path, text):
    info = {**INFO, "bestiary.tokenizer_json": "{}", "bestiary.tokenizer_config": text}
    with pytest.raises(BestiaryError, match="model info 'bestiary.tokenizer_config'"):
        open_source(golden_file(tmp_path / "g.flm", info))


def test_flm_convert_with_an_unhashable_info_value_exits_2(tmp_path, capsys):
    path = golden_file(tmp_path / "g.flm", {**INFO, "rope_scaling": "{[1]: 2}"})
    one_line(capsys, ["convert", "--model_dir", str(path), "--output_dir", str(tmp_path / "out")], 2,
             "g.flm (model info)", "rope_scaling")
