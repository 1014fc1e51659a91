"""The tiny valid inputs every fuzz case starts from, made once per fuzz root under ROOT/base.

    hf/           a 2-layer HF LLaMA (tests/helpers/tiny_llama.py) with a word-level tokenizer and a chat template
    ckpt/         its checkpoint (`bestiary convert`)
    engine/       its engine (`bestiary build --max_seq_len 96`)
    model.gguf    a 2-layer llama GGUF, SentencePiece tokenizer (tokenizer.ggml.model "llama"), F32/F16/Q8_0 tensors
    bpe.gguf      the same with a byte-level BPE tokenizer ("gpt2": tokens and merges)
    model.flm     the checkpoint written by `bestiary export` (the project's own .flm writer)
    text.txt      a text for `bestiary eval` and --calib_text
    template.jinja  a chat template file for `bestiary serve --chat_template`
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN, N_HEAD, N_KV, FFN, N_LAYER = 64, 4, 2, 96, 2
HEAD_DIM = HIDDEN // N_HEAD
TEXT = "w1 w2 w3 a b c w4 w5 w6 w7 w8 w9 w10 a b c " * 8
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
PARTS = ("hf", "ckpt", "engine", "model.gguf", "bpe.gguf", "model.flm", "text.txt", "template.jinja")


def build_base(root: Path) -> Path:
    """ROOT/base with every part of PARTS (made once: a READY file marks a finished base)."""
    base = root / "base"
    if (base / "READY").exists():
        return base
    tmp = root / "base.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _build_into(tmp)
    shutil.rmtree(base, ignore_errors=True)
    tmp.rename(base)
    (base / "READY").write_text("ok\n")
    return base


def _build_into(tmp: Path) -> None:
    """Write every part of PARTS into `tmp` (through the CLI where the project has a writer)."""
    from tiny_llama import make_tiny_engine

    from bestiary.core.cli.main import main

    make_tiny_engine(tmp, tokenizer=True, ckpt="ckpt")
    (tmp / "hf").joinpath("generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    write_gguf(tmp / "model.gguf", "llama")
    write_gguf(tmp / "bpe.gguf", "gpt2")
    if main(["export", "--checkpoint_dir", str(tmp / "ckpt"), "--output_file", str(tmp / "model.flm")]) != 0:
        raise RuntimeError("bestiary export of the tiny checkpoint failed")
    (tmp / "text.txt").write_text(TEXT)
    (tmp / "template.jinja").write_text(TEMPLATE)


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary: 3 specials, 256 byte tokens, scored pieces (merges come from scores)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["▁", "a", "b", "c", "w", "1", "2", "▁a", "▁b", "▁w", "ab", "▁ab", "▁abc"]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [1] * len(pieces)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (written out here: the fuzzer's parent process does
    not import torch)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet, a few merged words) and its merges."""
    alphabet = list(dict.fromkeys(byte_alphabet().values()))
    merged = ["ab", "abc", "he", "hel", "hell", "hello", "Ġa", "Ġab"]
    merges = ["a b", "ab c", "h e", "he l", "hel l", "hell o", "Ġ a", "Ġa b"]
    tokens = ["<|endoftext|>", *alphabet, *merged]
    return tokens, merges, [3] + [1] * (len(tokens) - 1)


def _tensors(vocab: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF tensor name -> (numpy shape, storage: f32 / f16 / q8_0) of the tiny llama."""
    specs = {"token_embd.weight": ((vocab, HIDDEN), "f16"), "output_norm.weight": ((HIDDEN,), "f32"),
             "output.weight": ((vocab, HIDDEN), "q8_0")}
    layer = {"attn_norm.weight": ((HIDDEN,), "f32"), "ffn_norm.weight": ((HIDDEN,), "f32"),
             "attn_q.weight": ((HIDDEN, HIDDEN), "q8_0"), "attn_k.weight": ((N_KV * HEAD_DIM, HIDDEN), "f32"),
             "attn_v.weight": ((N_KV * HEAD_DIM, HIDDEN), "f16"), "attn_output.weight": ((HIDDEN, HIDDEN), "q8_0"),
             "ffn_gate.weight": ((FFN, HIDDEN), "q8_0"), "ffn_up.weight": ((FFN, HIDDEN), "f32"),
             "ffn_down.weight": ((HIDDEN, FFN), "f16")}
    for n in range(N_LAYER):
        specs.update({f"blk.{n}.{name}": spec for name, spec in layer.items()})
    return specs


def gguf_metadata(tokenizer: str) -> dict[str, tuple[Any, Any, Any]]:
    """Key -> (value, GGUFValueType, array item type or None) of the tiny llama GGUF with a "llama"
    (SentencePiece) or "gpt2" (byte-level BPE) tokenizer."""
    from gguf import GGUFValueType as T

    if tokenizer == "llama":
        tokens, scores, types = spm_vocab()
        extra = {"tokenizer.ggml.scores": (scores, T.ARRAY, T.FLOAT32),
                 "tokenizer.ggml.bos_token_id": (1, T.UINT32, None),
                 "tokenizer.ggml.eos_token_id": (2, T.UINT32, None),
                 "tokenizer.ggml.unknown_token_id": (0, T.UINT32, None)}
    else:
        tokens, merges, types = bpe_vocab()
        extra = {"tokenizer.ggml.merges": (merges, T.ARRAY, T.STRING),
                 "tokenizer.ggml.bos_token_id": (0, T.UINT32, None),
                 "tokenizer.ggml.eos_token_id": (0, T.UINT32, None)}
    meta = {"llama.context_length": (128, T.UINT32, None), "llama.embedding_length": (HIDDEN, T.UINT32, None),
            "llama.block_count": (N_LAYER, T.UINT32, None), "llama.feed_forward_length": (FFN, T.UINT32, None),
            "llama.attention.head_count": (N_HEAD, T.UINT32, None),
            "llama.attention.head_count_kv": (N_KV, T.UINT32, None),
            "llama.rope.dimension_count": (HEAD_DIM, T.UINT32, None),
            "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32, None),
            "llama.rope.freq_base": (10000.0, T.FLOAT32, None), "llama.vocab_size": (len(tokens), T.UINT32, None),
            "tokenizer.ggml.model": (tokenizer, T.STRING, None), "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
            "tokenizer.ggml.token_type": (types, T.ARRAY, T.INT32)}
    meta.update(extra)
    meta["tokenizer.chat_template"] = (TEMPLATE, T.STRING, None)
    return meta


def gguf_tensors(vocab: int) -> dict[str, np.ndarray]:
    """GGUF tensor name -> its data as written (float32 / float16 arrays, Q8_0 blocks as uint8)."""
    import gguf

    rng = np.random.default_rng(0)
    out = {}
    for name, (shape, kind) in _tensors(vocab).items():
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        out[name] = (gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0) if kind == "q8_0"
                     else x.astype(np.float16) if kind == "f16" else x)
    return out


def write_gguf(path: Path, tokenizer: str, meta: dict[str, tuple[Any, Any, Any]] | None = None,
               tensors: dict[str, np.ndarray] | None = None, arch: str = "llama") -> None:
    """A tiny llama GGUF (gguf_metadata, gguf_tensors) or the `meta` and `tensors` given instead
    (uint8 arrays are Q8_0 blocks, any other array is written as its own dtype)."""
    import gguf

    meta = gguf_metadata(tokenizer) if meta is None else meta
    if tensors is None:
        tensors = gguf_tensors(len(meta["tokenizer.ggml.tokens"][0]))
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype, sub_type) in meta.items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, data in tensors.items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0 if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
