""".flm files as FastLLM's `model.save()` writes them: merged `mergeqkv` / `gateup_proj` tensors.

The same tiny GQA LLaMA is written twice here, byte by byte: once with the HF tensors (torch2flm's
layout) and once merged the way FastLLM merges while it loads an HF model (src/model.cpp,
CreateLLMModelFromHF: [q; k; v] and [gate; up] rows, each input's data memcpy'd after the previous
one, its per-row / per-row-and-group (min, max) configs appended) with the model info as FastLLM's
C++ writes it (JSON values). Both must read to the same tensors, quantized layouts and checkpoints.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from bestiary.core.cli.main import main
from bestiary.core.convert.flm_encode import fastllm_quantize
from bestiary.core.sources.flm_format import CODES, pack_int, pack_nibbles, pack_string
from bestiary.core.sources.flm_reader import read_flm
from bestiary.core.sources.flm_source import open_flm

pytest.importorskip("transformers")

HEADS, KV, HEAD_DIM, HIDDEN, INTER, VOCAB, LAYERS = 4, 2, 16, 64, 128, 96, 2
DTYPES = ["float16", "int8", "int4", "int4g32"]
MERGES = {"self_attn.mergeqkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"],
          "mlp.gateup_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}


def hf_config(json_values: bool) -> dict[str, str]:
    """The model info: torch2flm's str() values, or the JSON text FastLLM's C++ writes (model.save)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False,
              "attention_bias": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    if json_values:  # json11's dump: false, arrays over lines (as ftllm 1.9.0's model.save() wrote them)
        return {k: '[\n\t"LlamaForCausalLM"\n]' if k == "architectures" else
                v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    return {k: v if isinstance(v, str) else str(v) for k, v in config.items()}


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                   p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                   p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTER)}
    out = {}
    for name, shape in shapes.items():
        w = rng.normal(0, 0.2, shape)
        # asymmetric rows, as FastLLM's C++ quantizer meets them (zero points away from the middle)
        out[name] = (1 + w if len(shape) == 1 else w + rng.normal(0, 0.05, (shape[0], 1))).astype(np.float32)
    return out


def is_linear(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def encode(w: np.ndarray, dtype: str) -> tuple[int, bytes, bytes, bytes]:
    """(type code, header after the type, (min, max) pairs, data) of one tensor at `dtype`."""
    if dtype == "float16":
        return CODES["float16"], b"", b"", w.astype("<f2").tobytes()
    if dtype == "float32":
        return CODES["float32"], b"", b"", w.astype("<f4").tobytes()
    group = int(dtype[5:]) if dtype.startswith("int4g") else None
    bits = 8 if dtype == "int8" else 4
    codes, mins, maxs = fastllm_quantize(w, bits, group)
    pairs = np.stack([mins.reshape(-1), maxs.reshape(-1)], axis=1).astype("<f4").tobytes()
    data = codes.tobytes() if bits == 8 else pack_nibbles(codes)
    if group is None:
        return CODES["int8" if bits == 8 else "int4"], pack_int(0), pairs, data
    return CODES["int4g"], pack_int(0, w.shape[1] // group, group), pairs, data


def record(name: str, dims: tuple[int, ...], code: int, head: bytes, pairs: bytes, data: bytes) -> bytes:
    return pack_string(name) + pack_int(len(dims), *dims, code) + head + pairs + data


def write_flm(path: Path, dtype: str, merged: bool, weights: dict[str, np.ndarray] | None = None,
              info: dict[str, str] | None = None) -> Path:
    """The tiny model at `dtype` (linears; others float32), HF tensors or FastLLM's merged ones."""
    weights = weights if weights is not None else hf_weights()
    enc = {name: encode(w, dtype if is_linear(name) else "float32") for name, w in weights.items()}
    records = []
    for name, w in weights.items():
        merge = next((m for m, parts in MERGES.items() if merged and name.endswith(parts[0])), None)
        if merge is not None:
            prefix = name[: -len(MERGES[merge][0])]
            parts = [prefix + p for p in MERGES[merge]]
            rows = sum(weights[p].shape[0] for p in parts)
            code, head, _, _ = enc[name]
            pairs = b"".join(enc[p][2] for p in parts)  # configs appended, input by input
            data = b"".join(enc[p][3] for p in parts)  # memcpy of each input's bytes
            records.append(record(prefix + merge, (rows, w.shape[1]), code, head, pairs, data))
        elif not (merged and any(name.endswith(p) for parts in MERGES.values() for p in parts[1:])):
            records.append(record(name, w.shape, *enc[name]))
    info = info if info is not None else hf_config(json_values=merged)
    header = pack_int(2, len(info)) + b"".join(pack_string(k) + pack_string(v) for k, v in info.items())
    path.write_bytes(header + pack_int(0) + pack_int(len(records)) + b"".join(records))
    return path


@pytest.mark.parametrize("dtype", DTYPES)
def test_merged_tensors_read_as_the_hf_tensors(tmp_path, dtype):
    merged = open_flm(write_flm(tmp_path / "m.flm", dtype, merged=True))
    plain = open_flm(write_flm(tmp_path / "p.flm", dtype, merged=False))
    assert "model.layers.0.self_attn.mergeqkv.weight" in read_flm(tmp_path / "m.flm").tensors
    assert sorted(merged.weights.keys()) == sorted(plain.weights.keys())
    for key in plain.weights.keys():  # noqa: SIM118 - a WeightSource
        assert merged.weights.shape(key) == plain.weights.shape(key), key
        assert torch.equal(merged.weights.load(key), plain.weights.load(key)), key
    assert merged.hf_config == plain.hf_config  # JSON and str() model info parse alike
    layout = plain.hf_config.get("quantization_config")
    if layout:
        q_merged = merged.weights.prequantized(layout["bits"], layout["group_size"])
        q_plain = plain.weights.prequantized(layout["bits"], layout["group_size"])
        assert q_merged.keys() == q_plain.keys()
        for key in q_plain.keys():  # noqa: SIM118 - a WeightSource
            assert torch.equal(q_merged.load(key), q_plain.load(key)), key
    if dtype == "float16":  # the split is the HF tensor, to the bit
        hf = hf_weights()
        for key in ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
            assert torch.equal(merged.weights.load(key), torch.from_numpy(hf[key].astype(np.float16)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_merged_file_converts_to_the_same_checkpoint(tmp_path, dtype):
    from safetensors.torch import load_file

    for kind in ("merged", "plain"):
        flm = write_flm(tmp_path / f"{kind}.flm", dtype, merged=kind == "merged")
        assert main(["convert", "--model_dir", str(flm), "--output_dir", str(tmp_path / kind)]) == 0
    a, b = (load_file(tmp_path / kind / "rank0.safetensors") for kind in ("merged", "plain"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (json.loads((tmp_path / "merged" / "config.json").read_text())
            == json.loads((tmp_path / "plain" / "config.json").read_text()))


def run_convert(path: Path, tmp_path: Path, capsys) -> str:
    code = main(["convert", "--model_dir", str(path), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and str(path) in err, err
    return err


def test_merged_rows_that_disagree_with_the_heads_are_one_line_errors(tmp_path, capsys):
    info = hf_config(json_values=True) | {"num_key_value_heads": "1"}
    path = write_flm(tmp_path / "m.flm", "int8", merged=True, info=info)
    err = run_convert(path, tmp_path, capsys)
    assert "'model.layers.0.self_attn.mergeqkv.weight'" in err and "dims [128, 64] do not hold q, k, v" in err


def test_merged_and_unmerged_at_once_is_refused(tmp_path, capsys):
    path = write_flm(tmp_path / "m.flm", "float16", merged=True)
    extra = record("model.layers.0.self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN),
                   *encode(hf_weights()["model.layers.0.self_attn.q_proj.weight"], "float16"))
    data = bytearray(path.read_bytes())
    count_at = data.index(pack_string("model.embed_tokens.weight")) - 4
    (n,) = struct.unpack_from("<i", data, count_at)
    data[count_at:count_at + 4] = pack_int(n + 1)
    path.write_bytes(bytes(data) + extra)
    err = run_convert(path, tmp_path, capsys)
    assert "'model.layers.0.self_attn.mergeqkv.weight'" in err and "merged and unmerged at once" in err


def test_a_split_inside_a_byte_is_one_line_error(tmp_path):
    """int4 rows of an odd length: FastLLM's byte-wise merge cannot have kept the parts whole."""
    from bestiary.core.format.errors import WeightsError
    from bestiary.core.sources.flm_merged import split_rows

    w = np.random.default_rng(1).normal(size=(6, 5)).astype(np.float32)
    blob = pack_int(2, 1) + pack_string("model_type") + pack_string("llama") + pack_int(0, 1)
    blob += record("mlp.gateup_proj.weight", w.shape, *encode(w, "int4"))
    (tmp_path / "o.flm").write_bytes(blob)
    flm = read_flm(tmp_path / "o.flm")
    message = r"o\.flm: byte \d+: tensor 'mlp.gateup_proj.weight': row 3 starts inside a byte"
    with pytest.raises(WeightsError, match=message):
        split_rows(flm, flm.tensors["mlp.gateup_proj.weight"], {})


def test_a_merged_qkv_bias_splits_by_the_same_rows(tmp_path):
    """Qwen2's biases: FastLLM merges q / k / v biases into mergeqkv.bias alongside the weight."""
    bias = np.arange((HEADS + 2 * KV) * HEAD_DIM, dtype=np.float32)
    info = {k: v for k, v in hf_config(json_values=True).items() if k != "architectures"}
    blob = pack_int(2, len(info)) + b"".join(pack_string(k) + pack_string(v) for k, v in info.items())
    blob += pack_int(0, 1) + record("model.layers.0.self_attn.mergeqkv.bias", bias.shape, *encode(bias, "float32"))
    (tmp_path / "b.flm").write_bytes(blob)
    weights = open_flm(tmp_path / "b.flm").weights
    q, k = HEADS * HEAD_DIM, KV * HEAD_DIM
    for name, part in (("q", bias[:q]), ("k", bias[q:q + k]), ("v", bias[q + k:])):
        assert torch.equal(weights.load(f"model.layers.0.self_attn.{name}_proj.bias"), torch.from_numpy(part))
