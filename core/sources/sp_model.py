"""sentencepiece `.model` files without sentencepiece: the protobuf read by hand, turned into a Vocab.

A `.model` is a ModelProto (sentencepiece_model.proto):
    1 pieces (repeated): 1 piece string, 2 score float, 3 type (1 normal, 2 unknown, 3 control,
                         4 user defined, 5 unused, 6 byte)
    2 trainer_spec:      3 model_type (1 unigram, 2 BPE), 35 byte_fallback
    3 normalizer_spec:   1 name, 2 precompiled_charsmap, 3 add_dummy_prefix (default true),
                         4 remove_extra_whitespaces (default true)
`vocab_from_sp` gives the core.sources.vocab_tokenizer.Vocab: the normalization as tokenizers
normalizers (the precompiled charsmap, then sentencepiece's whitespace rules), control pieces as
special tokens, user-defined pieces matched whole.

THUDM ChatGLM tokenizers (`chatglm_tokenizer_files`): v1 (ice_text.model) shifts every id by
num_image_tokens and pre-processes text (\\n -> <n>, \\t -> <|tab|>, runs of n spaces ->
<|blank_n|>); v2/3 (tokenizer.model) appends [MASK] [gMASK] [sMASK] sop eop after the pieces.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bestiary.core.format.config import read_json
from bestiary.core.format.errors import BestiaryError
from bestiary.core.sources.base import TokenizerFiles
from bestiary.core.sources.chat_formats import (
    CHATGLM_SPECIALS,
    chat_template_for,
    chatglm_post_processor,
    chatglm_version,
)
from bestiary.core.sources.vocab_tokenizer import Vocab, tokenizer_json

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
V1_MAX_BLANK = 80  # THUDM v1: runs of 2..80 spaces are one <|blank_n|> piece


@dataclass
class SpModel:
    """The parts of a ModelProto a tokenizer needs."""

    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # (piece, score, type)
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of a protobuf message: ints for varints, bytes else."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated field")
        yield number, wire, value


def _int(value: int | bytes) -> int:
    """A varint field's value; ValueError for a field of another wire type."""
    if not isinstance(value, int):
        raise ValueError("a length-delimited field where a varint was expected")
    return value


def _bool(value: int | bytes) -> bool:
    return bool(_int(value))


def _bytes(value: int | bytes) -> bytes:
    """A length-delimited field's bytes; ValueError for a varint (bytes(n) would be n zero bytes)."""
    if not isinstance(value, bytes):
        raise ValueError("a varint where a length-delimited field was expected")
    return value


# ModelProto sub-message -> {field number: (SpModel attribute, conversion)}
SPEC_FIELDS: dict[int, dict[int, tuple[str, Callable[[int | bytes], object]]]] = {
    2: {3: ("model_type", _int), 35: ("byte_fallback", _bool)},  # trainer_spec
    3: {2: ("precompiled_charsmap", _bytes), 3: ("add_dummy_prefix", _bool),  # normalizer_spec
        4: ("remove_extra_whitespaces", _bool)},
}


def _piece(message: bytes) -> tuple[str, float, int]:
    piece, score, kind = "", 0.0, NORMAL
    for n, _, v in _fields(message):
        if n == 1:
            piece = _bytes(v).decode()
        elif n == 2:
            (score,) = struct.unpack("<f", _bytes(v))
        elif n == 3:
            kind = _int(v)
    return piece, score, kind


def parse_sp_model(data: bytes) -> SpModel:
    """The ModelProto in `data` (ValueError on a malformed message)."""
    model = SpModel()
    for number, _, value in _fields(data):
        if number == 1:
            model.pieces.append(_piece(_bytes(value)))
        for n, _, v in _fields(_bytes(value)) if number in SPEC_FIELDS else ():
            if n in SPEC_FIELDS[number]:
                name, convert = SPEC_FIELDS[number][n]
                setattr(model, name, convert(v))
    if not model.pieces:
        raise ValueError("no pieces")
    return model


def read_sp_model(path: Path) -> SpModel:
    try:
        return parse_sp_model(Path(path).read_bytes())
    except (ValueError, UnicodeDecodeError, struct.error) as err:
        raise BestiaryError(f"{path}: not a sentencepiece model ({err})") from None


def _normalizers(model: SpModel) -> list[dict[str, Any]]:
    """tokenizers normalizer JSON of `model`'s normalizer_spec: its precompiled charsmap, its whitespace rules."""
    steps: list[dict[str, Any]] = []
    if model.precompiled_charsmap:
        steps.append({"type": "Precompiled",
                      "precompiled_charsmap": base64.b64encode(model.precompiled_charsmap).decode()})
    if model.remove_extra_whitespaces:
        steps += [{"type": "Strip", "strip_left": True, "strip_right": True},
                  {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]
    return steps


def vocab_from_sp(model: SpModel, offset: int = 0) -> Vocab:
    """The Vocab of `model`, ids shifted by `offset` (placeholders below it)."""
    pieces: list[str | None] = [None] * offset + [p for p, _, _ in model.pieces]
    scores = [-1e9] * offset + [s for _, s, _ in model.pieces]
    unk = next((p for p, _, kind in model.pieces if kind == UNKNOWN), None)
    return Vocab(pieces, scores, unigram=model.model_type == UNIGRAM, add_dummy_prefix=model.add_dummy_prefix,
                 special=[p for p, _, kind in model.pieces if kind == CONTROL],
                 user_defined=[p for p, _, kind in model.pieces if kind == USER_DEFINED],
                 unk=unk, normalizers=_normalizers(model))


# ---- THUDM ChatGLM -------------------------------------------------------------------------------


def _replace(a: str, b: str) -> dict[str, Any]:
    return {"type": "Replace", "pattern": {"String": a}, "content": b}


def chatglm_v1_rules(vocab: Vocab) -> None:
    """THUDM v1's text pre-processing (<n>, <|tab|>, <|blank_n|>) as normalizers and decoders."""
    have = set(vocab.pieces)
    pairs = [("\n", "<n>"), ("\t", "<|tab|>")]
    pairs += [(" " * n, f"<|blank_{n}|>") for n in range(V1_MAX_BLANK, 1, -1)]
    pairs = [(a, b) for a, b in pairs if b in have]
    vocab.normalizers = [_replace(a, b) for a, b in pairs] + vocab.normalizers
    vocab.decoders += [_replace(b, a) for a, b in pairs]
    vocab.user_defined = list(dict.fromkeys(vocab.user_defined + [b for _, b in pairs]))


def chatglm_vocab(vocab: Vocab, version: int) -> Vocab:
    """ChatGLM's special tokens made whole tokens (v2/3: appended after the pieces when absent)."""
    if version == 1:
        chatglm_v1_rules(vocab)
    for token in CHATGLM_SPECIALS[version]:
        if token not in vocab.pieces and version == 2:
            vocab.pieces.append(token)
            vocab.scores.append(0.0)
        if token in vocab.pieces and token not in vocab.special:
            vocab.special.append(token)
    return vocab


def chatglm_tokenizer(vocab: Vocab, config: dict[str, Any]) -> TokenizerFiles:
    """tokenizer.json + tokenizer_config for a ChatGLM vocab: specials, prompt tokens, rounds, bos/eos."""
    version = chatglm_version(config) or 2
    vocab = chatglm_vocab(vocab, version)
    ids = {p: i for i, p in enumerate(vocab.pieces) if p is not None}
    tok_config: dict[str, Any] = {"chat_template": chat_template_for(config)}
    for key, default in (("bos", "<sop>" if version == 1 else None), ("eos", "<eop>" if version == 1 else "</s>"),
                         ("pad", None)):
        token_id = config.get(f"{key}_token_id")
        name = vocab.pieces[token_id] if isinstance(token_id, int) and 0 <= token_id < len(vocab.pieces) else default
        if name is not None:
            tok_config[f"{key}_token"] = name
    return TokenizerFiles(tokenizer_json(vocab, chatglm_post_processor(version, ids)), tok_config)


SP_FILES = ("tokenizer.model", "ice_text.model")


def sentencepiece_tokenizer_files(directory: Path, hf_config: dict[str, Any]) -> TokenizerFiles | None:
    """The tokenizer of an HF directory that has a sentencepiece model but no tokenizer.json."""
    directory = Path(directory)
    config = read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").is_file() else {}
    names = [config["vocab_file"]] if isinstance(config.get("vocab_file"), str) else list(SP_FILES)
    path = next((directory / n for n in names if (directory / n).is_file()), None)
    if path is None:
        return None
    model = read_sp_model(path)
    version = chatglm_version(hf_config)
    if version is not None:
        offset = _image_tokens(config, directory) if version == 1 else 0
        return chatglm_tokenizer(vocab_from_sp(model, offset), hf_config)
    vocab = vocab_from_sp(model)
    tok_config = {k: v for k, v in config.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token",
                                                            "add_bos_token", "add_eos_token", "chat_template")}
    return TokenizerFiles(tokenizer_json(vocab), tok_config)


def _image_tokens(config: dict[str, Any], directory: Path) -> int:
    """ChatGLM-6B's num_image_tokens (tokenizer_config.json; default 20000): the ids before the text pieces."""
    value = config.get("num_image_tokens")
    if value is None:
        return 20000
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 2**24:
        raise BestiaryError(f"{directory / 'tokenizer_config.json'}: field 'num_image_tokens': expected an integer "
                            f"in 0..{2**24} (got {value!r:.60})")
    return value
