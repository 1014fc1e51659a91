"""FastLLM's `.flm` model file, byte by byte (torch2flm.tofile / WeightMap::LoadFromFile), version 2.

All integers are little-endian int32, floats float32; a *string* is int32 byte length + UTF-8 bytes.

    int32 version                      2
    int32 n_info, n_info x (string key, string value)    the HF config + generation config, every value
                                       str()-ed; FastLLM's chat keys pre_prompt, user_role, bot_role,
                                       history_sep; tokenizer flags (tokenizer_use_score, ...)
    [peft adapters when info has peft_size: not supported]
    int32 n_vocab, n_vocab x (int32 len, len x int32 (one per byte of the token), int32 id,
                              float32 score  -- only when info tokenizer_use_score == "1")
    [int32 n, n x string  -- special tokens, only when info tokenizer_has_special_tokens == "1"]
    int32 n_tensors, n_tensors x:
        string name, int32 ndims, ndims x int32 dims, int32 data type, then by type:
        0 float32 / 1 bfloat16 / 7 float16:  prod(dims) values
        3 int8, 4 int4 (zero point), 8 int4 (no zero point):
              int32 axis (-1: one config; else one per index of dims[axis]),
              k x (float32 min, float32 max), then the codes: uint8 per value (int8), or two
              4-bit codes per byte, the even element in the high nibble (int4), ceil(n / 2) bytes
        9 int4 grouped:  int32 axis, int32 groups, int32 group_size,
              dims[axis] * groups x (float32 min, float32 max), then the 4-bit codes as above

A (min, max) pair means what FastLLM's LowBitConfig makes of it (`low_bit_grid`):
    min' = min(min, 0), max' = max(max, 0), s = (max' - min') / (2^bits - 1),
    z = clamp(round(-min' / s), 0, 2^bits - 1),   w = (q - z) * s
(computed in float32, as FastLLM does). The int8 exporter writes (-m, m) with m = max|w| per row,
so its zero point is 128.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

VERSION = 2


@dataclass(frozen=True)
class FlmType:
    """One .flm data type: its code, name, bits per value and how its header reads."""

    code: int
    name: str
    bits: int
    quantized: bool = False
    grouped: bool = False


TYPES: dict[int, FlmType] = {
    t.code: t
    for t in (
        FlmType(0, "float32", 32),
        FlmType(1, "bfloat16", 16),
        FlmType(7, "float16", 16),
        FlmType(3, "int8", 8, quantized=True),
        FlmType(4, "int4z", 4, quantized=True),
        FlmType(8, "int4", 4, quantized=True),
        FlmType(9, "int4g", 4, quantized=True, grouped=True),
    )
}
CODES: dict[str, int] = {t.name: code for code, t in TYPES.items()}
NUMPY_FLOAT = {0: np.float32, 7: np.float16}  # bfloat16 (1) is read through torch

# Info keys FastLLM's chat uses (basellm::MakeInput / MakeHistory).
CHAT_KEYS = ("pre_prompt", "user_role", "bot_role", "history_sep")


def data_bytes(ftype: FlmType, count: int) -> int:
    """Bytes of the values/codes of a tensor of `count` elements (FastLLM's Data::GetBytes)."""
    return (count * ftype.bits + 7) // 8


def low_bit_grid(mins: np.ndarray, maxs: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """FastLLM's LowBitConfig over arrays of (min, max): (scale s, zero point z) float32 with w = (q - z) * s.

    A row of zeros (s == 0) gets z = 0, so it dequantizes to zeros.
    """
    qmax = np.float32((1 << bits) - 1)
    lo = np.minimum(mins.astype(np.float32), np.float32(0))
    hi = np.maximum(maxs.astype(np.float32), np.float32(0))
    s = ((hi - lo) / qmax).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        z0 = np.float32(0) - lo / s
    z = np.where(s > 0, np.clip(np.round(np.nan_to_num(z0)), 0, qmax), 0).astype(np.float32)
    return s, z


def grid_bounds(s: np.ndarray, z: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) to write so that `low_bit_grid` gives back the zero points z (and s to rounding)."""
    qmax = (1 << bits) - 1
    s = s.astype(np.float32)
    return (-z * s).astype(np.float32), ((qmax - z) * s).astype(np.float32)


def unpack_nibbles(raw: np.ndarray, count: int) -> np.ndarray:
    """uint8 bytes -> `count` 4-bit codes, the even element in the high nibble (FastLLM's order)."""
    codes = np.empty(raw.size * 2, dtype=np.uint8)
    codes[0::2] = raw >> 4
    codes[1::2] = raw & 0xF
    return codes[:count]


def pack_nibbles(codes: np.ndarray) -> bytes:
    """4-bit codes (flat) -> bytes, the even element in the high nibble (inverse of unpack_nibbles)."""
    c = codes.astype(np.uint8).reshape(-1)
    if c.size % 2:
        c = np.concatenate([c, np.zeros(1, dtype=np.uint8)])
    return ((c[0::2] << 4) | c[1::2]).astype(np.uint8).tobytes()


def pack_int(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def pack_string(text: str) -> bytes:
    data = text.encode()
    return pack_int(len(data)) + data


def pack_token(piece: bytes, token_id: int, score: float | None) -> bytes:
    """One vocab entry: length, one int32 per byte, id, and the score when the file has scores."""
    out = pack_int(len(piece), *piece, token_id)
    return out if score is None else out + struct.pack("<f", score)
