"""A .safetensors file read one tensor at a time with plain reads, its header validated whole first.

`bestiary export` reads rank files this way: a memory map would keep every page it touched resident.
The file may come from anywhere, so nothing in it is trusted: when the file is opened, the 8-byte
header length must fit the file (and safetensors' own 100 MB header limit), the header must be UTF-8
JSON holding an object, and each tensor's entry must name a known dtype, a shape of non-negative
integers and `data_offsets` inside the data section spanning exactly dtype size x element count.
Every failure is one WeightsError line naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from bestiary.core.format.checkpoint import SAFETENSORS_DTYPES
from bestiary.core.format.errors import WeightsError

DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header
SHOWN_CHARS = 60  # a bad value is quoted up to this many characters


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: dtype, shape, absolute file offset and byte count."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def _shown(value: object) -> str:
    """repr of a bad value, cut to SHOWN_CHARS so the error stays one short line."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _is_int(value: object) -> bool:
    """An integer that JSON wrote as one (not true / false)."""
    return isinstance(value, int) and not isinstance(value, bool)


def read_header_json(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int, int]:
    """(the header object, data section start, data section length) of the open file `f`."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) != 8:
        raise WeightsError(f"{path}: not a .safetensors file ({size} bytes; expected an 8-byte header length first)")
    (length,) = struct.unpack("<Q", head)
    if not 2 <= length <= size - 8:
        raise WeightsError(f"{path}: safetensors header length {length} does not fit the file "
                           f"({size} bytes; expected 2 to {max(size - 8, 0)})")
    if length > MAX_HEADER_BYTES:
        raise WeightsError(f"{path}: safetensors header length {length} is over the {MAX_HEADER_BYTES}-byte limit")
    raw = f.read(length)
    if len(raw) != length:
        raise WeightsError(f"{path}: file ends inside the safetensors header (truncated while reading?)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise WeightsError(f"{path}: safetensors header is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset "
                           f"{8 + err.start})") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError; so are over-long integers
        raise WeightsError(f"{path}: safetensors header is not valid JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: safetensors header is a JSON {type(header).__name__}; expected an object")
    return header, 8 + length, size - 8 - length


def tensor_entry(path: Path, name: str, value: object, data_start: int, data_len: int) -> TensorEntry:
    """The validated entry of tensor `name` (its header value `value`)."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(value, dict):
        raise WeightsError(f"{where}: header entry {_shown(value)}; expected an object with dtype, shape, data_offsets")
    dtype_name, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise WeightsError(f"{where}: dtype {_shown(dtype_name)}; expected one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise WeightsError(f"{where}: shape {_shown(shape)}; expected a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise WeightsError(f"{where}: data_offsets {_shown(offsets)}; expected [start, end] (two integers)")
    if not 0 <= offsets[0] <= offsets[1]:
        raise WeightsError(f"{where}: data_offsets {_shown(offsets)}; expected [start, end] with 0 <= start <= end")
    if offsets[1] > data_len:
        raise WeightsError(f"{where}: data_offsets {_shown(offsets)} end past the data section's {data_len} bytes "
                           f"(the file is truncated or its header is corrupt)")
    dtype = DTYPES[dtype_name]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if offsets[1] - offsets[0] != nbytes:
        raise WeightsError(f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes; "
                           f"{dtype_name} {shape} needs {nbytes}")
    return TensorEntry(dtype, tuple(shape), data_start + offsets[0], nbytes)


def read_header(f: BinaryIO, path: Path) -> dict[str, TensorEntry]:
    """Every tensor's validated entry, in header order (`__metadata__` skipped); together they tile the data
    section exactly (check_tiling)."""
    header, data_start, data_len = read_header_json(f, path)
    entries = {name: tensor_entry(path, name, value, data_start, data_len)
               for name, value in header.items() if name != "__metadata__"}
    check_tiling(path, entries, data_start, data_len)
    return entries


def check_tiling(path: Path, entries: dict[str, TensorEntry], data_start: int, data_len: int) -> None:
    """The tensors' byte ranges, in file order, follow one another with no gap or overlap and end at the
    data section's end (the safetensors format's rule: two tensors sharing bytes, or bytes no tensor owns,
    mean a corrupt header)."""
    at = data_start
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].nbytes)):
        if entry.start != at:
            what = "overlaps the tensor before it" if entry.start < at else "leaves a gap before it"
            raise WeightsError(f"{path}: tensor {name!r}: data_offsets start at {entry.start - data_start}, which "
                               f"{what} (expected {at - data_start}): the header is corrupt")
        at += entry.nbytes
    if at != data_start + data_len:
        raise WeightsError(f"{path}: the tensors end at byte {at - data_start} of a {data_len}-byte data section "
                           f"(bytes no tensor owns: the file or its header is corrupt)")


class SafetensorsStream:
    """Tensors of a .safetensors file read one at a time with plain reads; the header is validated when
    the file is opened (`read_header`), so a bad file fails before any tensor is used."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = open(self.path, "rb")  # noqa: SIM115 - closed by __exit__ (or here on a bad header)
        try:
            self.entries = read_header(self.file, self.path)
        except BaseException:
            self.file.close()
            raise

    def __enter__(self) -> SafetensorsStream:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def keys(self) -> list[str]:
        """Tensor names in header order."""
        return list(self.entries)

    def get_tensor(self, key: str) -> torch.Tensor:
        """Tensor `key`, read into memory of its own (64-byte aligned: kernels may use it as it is); a file cut
        short since it was opened is a WeightsError."""
        entry = self.entries[key]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        tensor = torch.empty(entry.shape, dtype=entry.dtype)  # torch's CPU allocator: 64-byte aligned
        self.file.seek(entry.start)
        got = self.file.readinto(tensor.reshape(-1).view(torch.uint8).numpy().data)  # the array's memoryview
        if got != entry.nbytes:
            raise WeightsError(f"{self.path}: tensor {key!r}: file ends {entry.nbytes - got} bytes early "
                               f"(truncated while reading?)")
        return tensor
