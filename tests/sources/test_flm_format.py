"""FastLLM .flm files written by hand here, byte by byte from FastLLM's layout (torch2flm.tofile):
golden values, every data type, and one-line errors (byte offset + tensor) for broken files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from bestiary.core.cli.main import main
from bestiary.core.sources import open_source
from bestiary.core.sources.flm_reader import FlmFormatError, read_flm
from bestiary.core.sources.flm_source import open_flm


def i32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def string(text: str) -> bytes:
    data = text.encode()
    return i32(len(data)) + data


def token(piece: str, token_id: int, score: float | None = None) -> bytes:
    data = piece.encode()
    out = i32(len(data), *data, token_id)  # one int32 per byte, then the id (and the score)
    return out if score is None else out + f32(score)


def tensor(name: str, dims: list[int], code: int, payload: bytes) -> bytes:
    return string(name) + i32(len(dims), *dims, code) + payload


INFO = {"model_type": "llama", "architectures": "['LlamaForCausalLM']", "hidden_size": "4",
        "rms_norm_eps": "1e-05", "tie_word_embeddings": "False", "rope_scaling.type": "linear",
        "rope_scaling.factor": "2.0", "user_role": "<user>", "bot_role": "<bot>", "history_sep": "\n",
        "pre_prompt": "SYS "}
NORM = [1.0, -2.5, 0.25, 3.0]
WEIGHT16 = np.array([[0.5, -1.0, 2.0], [4.0, 0.0, -0.125]], dtype=np.float16)


def golden_file(path: Path, info: dict = INFO, tail: bytes = b"") -> Path:
    """Header, info, vocab (no scores), 2 tensors: float32 norm [4] and float16 weight [2, 3]."""
    data = i32(2, len(info)) + b"".join(string(k) + string(v) for k, v in info.items())
    data += i32(3) + token("a", 0) + token("b", 1) + token("ab", 2)
    data += i32(2)
    data += tensor("model.norm.weight", [4], 0, f32(*NORM))
    data += tensor("lm_head.weight", [2, 3], 7, WEIGHT16.tobytes())
    path.write_bytes(data + tail)
    return path


def test_golden_file_reads_to_the_expected_values(tmp_path):
    flm = read_flm(golden_file(tmp_path / "g.flm"))
    assert flm.info == INFO
    assert flm.vocab == [(b"a", 0, None), (b"b", 1, None), (b"ab", 2, None)]
    assert list(flm.tensors) == ["model.norm.weight", "lm_head.weight"]
    source = open_source(tmp_path / "g.flm")
    assert source.format == "flm"
    assert torch.equal(source.weights.load("model.norm.weight"), torch.tensor(NORM))
    w = source.weights.load("lm_head.weight")
    assert w.dtype == torch.float16 and torch.equal(w, torch.from_numpy(WEIGHT16))
    config = source.hf_config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 4
    assert config["tie_word_embeddings"] is False and config["rms_norm_eps"] == 1e-5
    assert config["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert config["history_sep"] == "\n" and config["torch_dtype"] == "float16"


def test_chat_keys_become_the_chat_template(tmp_path):
    from bestiary.core.runtime.tokenizer import Tokenizer

    source = open_flm(golden_file(tmp_path / "g.flm"))
    tok = Tokenizer(source.tokenizer.tokenizer_json, source.tokenizer.tokenizer_config)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"}]
    # FastLLM: pre_prompt + user_role + input + bot_role + output + history_sep, then the new round
    assert tok.apply_chat_template(chat) == "SYS <user>hi<bot>yo\n<user>q<bot>"
    # the vocab's scores are -index (no tokenizer_use_score): "ab" is one merged token
    assert tok.encode("ab", add_special_tokens=False) == [2]


def lowbit(mn: float, mx: float, bits: int) -> tuple[float, float]:
    """FastLLM's LowBitConfig, transcribed: (scale, zero point)."""
    mn, mx = np.float32(min(mn, 0.0)), np.float32(max(mx, 0.0))
    qmax = np.float32(2**bits - 1)
    scale = np.float32((mx - mn) / qmax)
    zero = float(np.clip(np.round(np.float32(0) - mn / scale), 0, qmax))
    return float(scale), zero


@pytest.mark.parametrize("code", [3, 8, 9])
def test_quantized_types_dequantize_as_fastllm_does(tmp_path, code):
    rng = np.random.default_rng(code)
    rows, k = 3, 8
    bits = 8 if code == 3 else 4
    q = rng.integers(0, 2**bits, size=(rows, k)).astype(np.uint8)
    groups, gsize = (2, 4) if code == 9 else (1, k)
    bounds = [(float(-rng.uniform(0.1, 2)), float(rng.uniform(0.1, 2))) for _ in range(rows * groups)]
    head = i32(0) + (i32(groups, gsize) if code == 9 else b"")
    pairs = f32(*[v for pair in bounds for v in pair])
    flat = q.reshape(-1)
    data = flat.tobytes() if bits == 8 else bytes(int(a) << 4 | int(b) for a, b in zip(flat[0::2], flat[1::2]))
    info = {"model_type": "llama"}
    blob = i32(2, 1) + string("model_type") + string("llama") + i32(0, 1)
    blob += tensor("x.weight", [rows, k], code, head + pairs + data)
    (tmp_path / "q.flm").write_bytes(blob)
    got = open_flm(tmp_path / "q.flm").weights.load("x.weight")
    expected = np.zeros((rows, k), dtype=np.float32)
    for r in range(rows):
        for c in range(k):
            s, z = lowbit(*bounds[r * groups + c // gsize], bits)
            expected[r, c] = (np.float32(q[r, c]) - np.float32(z)) * np.float32(s)
    assert info and torch.equal(got, torch.from_numpy(expected))


def run_convert(path: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    code = main(["convert", "--model_dir", str(path), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    return code, err


def broken_cases(tmp_path: Path) -> dict[str, tuple[bytes, str]]:
    good = golden_file(tmp_path / "good.flm").read_bytes()
    weight_at = good.index(b"lm_head.weight") - 4
    type_at = weight_at + 4 + len("lm_head.weight") + 4 + 8
    unknown = bytearray(good)
    unknown[type_at:type_at + 4] = i32(42)
    return {
        "truncated": (good[:-5], "truncated file"),
        "version": (i32(3) + good[4:], "version id 3"),
        "dtype": (bytes(unknown), "unknown data type code 42"),
        "dims": (good + b"\0" * 6, "disagree with the data length"),
    }


@pytest.mark.parametrize("case", ["truncated", "version", "dtype", "dims"])
def test_broken_files_are_one_line_errors_with_offset_and_tensor(tmp_path, capsys, case):
    data, expected = broken_cases(tmp_path)[case]
    path = tmp_path / f"{case}.flm"
    path.write_bytes(data)
    with pytest.raises(FlmFormatError, match="byte [0-9]+"):
        read_flm(path)
    code, err = run_convert(path, tmp_path, capsys)
    assert code == 2 and expected in err and len(err.splitlines()) == 1, err
    assert str(path) in err
    if case != "version":
        assert "'lm_head.weight'" in err
    assert not (tmp_path / "out").exists()


def test_dims_that_overrun_the_file_name_the_tensor(tmp_path):
    good = golden_file(tmp_path / "g.flm").read_bytes()
    at = good.index(b"lm_head.weight") + len("lm_head.weight") + 4
    bad = bytearray(good)
    bad[at:at + 4] = i32(2000)  # dims [2000, 3]: more data than the file holds
    (tmp_path / "b.flm").write_bytes(bytes(bad))
    with pytest.raises(FlmFormatError, match=r"byte \d+: truncated file: float16 data of dims \[2000, 3\].*'lm_head.weight'"):
        read_flm(tmp_path / "b.flm")
