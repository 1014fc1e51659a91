"""Parsing a `.flm` file (layout in core.sources.flm_format) into an index, without reading the weights.

`read_flm(path)` memory-maps the file and walks it once: header, model info, vocab, special
tokens, then each tensor's name, dims, type and quantization header; the values stay in the
map. Every inconsistency is a `FlmFormatError`, one line naming the file, the byte offset and
the tensor: a wrong version, a truncated file, an unknown data type code, dims whose data runs
past the end of the file, or bytes left over after the last tensor.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bestiary.core.format.errors import WeightsError
from bestiary.core.sources.flm_format import TYPES, VERSION, FlmType, data_bytes

MAX_DIMS = 8


class FlmFormatError(WeightsError):
    """A .flm file that does not follow the layout (message: file, byte offset, tensor)."""


@dataclass(frozen=True)
class FlmTensor:
    """One tensor of a .flm file: where its quantization header and its values are."""

    name: str
    dims: tuple[int, ...]
    ftype: FlmType
    offset: int  # byte offset of its name (for messages)
    data_offset: int  # first byte of the values / codes
    axis: int = -1  # quantized: the dim with one (min, max) per index (-1: one for the tensor)
    groups: int = 1  # int4g: groups per index of dims[axis]
    group_size: int = 0  # int4g: values per group
    bounds_offset: int = 0  # quantized: first byte of the (min, max) float32 pairs
    part_of: str = ""  # the merged tensor (model.save()) whose rows these are (core.sources.flm_merged)

    @property
    def count(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1

    @property
    def label(self) -> str:
        """The tensor as error messages name it: 'q_proj...' (of 'mergeqkv...') for a merged part."""
        return f"{self.name!r} (of {self.part_of!r})" if self.part_of else repr(self.name)

    @property
    def configs(self) -> int:
        """Number of (min, max) pairs."""
        rows = 1 if self.axis == -1 else self.dims[self.axis]
        return rows * self.groups


@dataclass
class FlmFile:
    """The index of a .flm file: model info, vocab, special tokens, tensors (values left in `data`)."""

    path: Path
    data: mmap.mmap | bytes
    info: dict[str, str]
    vocab: list[tuple[bytes, int, float | None]]
    special_tokens: list[str]
    tensors: dict[str, FlmTensor] = field(default_factory=dict)


class _Cursor:
    """Reads little-endian int32 / float32 / strings from `data`, with offsets in every error."""

    def __init__(self, data: mmap.mmap | bytes, path: Path) -> None:
        self.data, self.path, self.pos = data, path, 0
        self.size = len(data)
        self.tensor: str | None = None  # named in errors once known

    def fail(self, message: str, at: int | None = None) -> FlmFormatError:
        where = f" (tensor {self.tensor!r})" if self.tensor else ""
        return FlmFormatError(f"{self.path}: byte {self.pos if at is None else at}: {message}{where}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated file: {what} needs {n} bytes, {self.size - self.pos} left")

    def int32(self, what: str) -> int:
        self.need(4, what)
        value: int
        (value,) = struct.unpack_from("<i", self.data, self.pos)
        self.pos += 4
        return value

    def float32(self, what: str) -> float:
        self.need(4, what)
        value: float
        (value,) = struct.unpack_from("<f", self.data, self.pos)
        self.pos += 4
        return value

    def count(self, what: str, limit: int) -> int:
        at = self.pos
        n = self.int32(what)
        if not 0 <= n <= limit:
            raise self.fail(f"{what} {n} is out of range (0..{limit})", at)
        return n

    def raw(self, n: int, what: str) -> bytes:
        self.need(n, what)
        out = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return out

    def string(self, what: str) -> str:
        n = self.count(f"length of {what}", self.size)
        at = self.pos
        try:
            return self.raw(n, what).decode()
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8", at) from None

    def skip(self, n: int, what: str) -> int:
        """Skip n bytes; returns where they start."""
        self.need(n, what)
        at = self.pos
        self.pos += n
        return at


def _read_vocab(cur: _Cursor, use_score: bool) -> list[tuple[bytes, int, float | None]]:
    n = cur.count("vocab size", cur.size // 8)
    vocab = []
    for i in range(n):
        length = cur.count(f"length of vocab entry {i}", cur.size // 4)
        at = cur.pos
        chars = np.frombuffer(cur.raw(4 * length, f"vocab entry {i}"), dtype="<i4")
        if chars.size and (chars.min() < 0 or chars.max() > 255):
            raise cur.fail(f"vocab entry {i} holds a value outside 0..255 (one int32 per byte expected)", at)
        token_id = cur.int32(f"id of vocab entry {i}")
        score = cur.float32(f"score of vocab entry {i}") if use_score else None
        vocab.append((chars.astype(np.uint8).tobytes(), token_id, score))
    return vocab


def _read_tensor(cur: _Cursor) -> FlmTensor:
    offset = cur.pos
    cur.tensor = None
    name = cur.string("tensor name")
    cur.tensor = name
    at = cur.pos
    ndims = cur.int32("number of dims")
    if not 0 <= ndims <= MAX_DIMS:
        raise cur.fail(f"number of dims {ndims} is out of range (0..{MAX_DIMS})", at)
    dims = []
    for d in range(ndims):
        at = cur.pos
        size = cur.int32(f"dim {d}")
        if size < 0:
            raise cur.fail(f"dim {d} is {size}, expected >= 0", at)
        dims.append(size)
    at = cur.pos
    code = cur.int32("data type")
    ftype = TYPES.get(code)
    if ftype is None:
        known = ", ".join(f"{t.name} {c}" for c, t in TYPES.items())
        raise cur.fail(f"unknown data type code {code} (known: {known})", at)
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    axis, groups, group_size, bounds_offset = -1, 1, 0, 0  # FlmTensor's defaults: a float tensor
    if ftype.quantized:
        at = cur.pos
        axis = cur.int32("quantization axis")
        if not -1 <= axis < max(ndims, 1) or (axis >= 0 and ndims == 0):
            raise cur.fail(f"quantization axis {axis} is out of range for dims {dims}", at)
        if ftype.grouped:
            at = cur.pos
            groups, group_size = cur.int32("group count"), cur.int32("group size")
            last = dims[-1] if dims else 1
            if group_size <= 0 or groups != -(-last // group_size):
                raise cur.fail(f"{groups} groups of {group_size} do not cover the last dim {last} of dims {dims}", at)
        configs = (1 if axis == -1 else dims[axis]) * groups
        bounds_offset = cur.skip(8 * configs, f"{configs} (min, max) pairs of dims {dims}")
    nbytes = data_bytes(ftype, count)
    data_offset = cur.skip(nbytes, f"{ftype.name} data of dims {dims}")
    return FlmTensor(name, tuple(dims), ftype, offset, data_offset, axis=axis, groups=groups, group_size=group_size,
                     bounds_offset=bounds_offset)


def _map(path: Path) -> mmap.mmap | bytes:
    """`path`'s bytes, memory-mapped (an empty file, which mmap refuses: b"")."""
    with open(path, "rb") as f:
        if path.stat().st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_flm(path: str | Path) -> FlmFile:
    """Index `path` (FlmFormatError, one line, on any inconsistency)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such .flm file")
    data = _map(path)
    cur = _Cursor(data, path)
    version = cur.int32("version id")
    if version != VERSION:
        raise cur.fail(f"version id {version}: expected {VERSION} (FastLLM .flm version 2)", 0)
    info = {}
    for i in range(cur.count("number of model info entries", cur.size // 8)):
        key = cur.string(f"model info key {i}")
        info[key] = cur.string(f"model info value of {key!r}")
    peft = info.get("peft_size", "0").strip() or "0"
    if not set(peft) <= set("0123456789"):  # FastLLM writes the count of LoRA adapters the file holds
        raise cur.fail(f"model info 'peft_size' = {peft[:40]!r}: expected a count of LoRA adapters (0)")
    if peft.strip("0"):
        raise cur.fail("LoRA adapters (peft_size) inside a .flm file are not supported")
    vocab = _read_vocab(cur, info.get("tokenizer_use_score") == "1")
    specials = []
    if info.get("tokenizer_has_special_tokens") == "1":
        specials = [cur.string(f"special token {i}") for i in range(cur.count("special tokens", cur.size // 4))]
    flm = FlmFile(path, data, info, vocab, specials)
    n = cur.count("number of tensors", cur.size // 12)
    for _ in range(n):
        tensor = _read_tensor(cur)
        if tensor.name in flm.tensors:
            raise cur.fail("tensor name appears twice", tensor.offset)
        flm.tensors[tensor.name] = tensor
    if cur.pos != cur.size:
        last = next(reversed(flm.tensors), None)
        cur.tensor = last
        what = f"the dims {list(flm.tensors[last].dims)} of the last tensor" if last else "the tensor count"
        raise cur.fail(f"{cur.size - cur.pos} bytes after the end of the data: {what} disagree with the data length")
    return flm

