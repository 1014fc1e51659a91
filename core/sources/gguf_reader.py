"""A GGUF reader whose metadata arrays cost what their values cost.

gguf-py's `GGUFReader` keeps every element of a metadata array as its own numpy views (a string
is two: its length and its bytes), so SmolLM2's 49152 tokens and 48900 merges become ~245,000
numpy objects: ~160 MB resident for a 90 MB file, held for the whole of a convert (the largest
thing it holds; issue 27's convert-memory target). `CompactGGUFReader` is that reader with one
change: an array of scalars or strings is parsed straight into one Python list, kept in a
`CompactField` with the same `contents()` / `types` / `data` interface (`data` has one entry per
element, as gguf-py's has). Tensors, alignment and every check stay gguf-py's. A file in the
other byte order, or an array of arrays, is read by gguf-py's own code.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

_SCALARS = {  # GGUF scalar type -> (struct code, size)
    GGUFValueType.UINT8: ("B", 1), GGUFValueType.INT8: ("b", 1), GGUFValueType.UINT16: ("H", 2),
    GGUFValueType.INT16: ("h", 2), GGUFValueType.UINT32: ("I", 4), GGUFValueType.INT32: ("i", 4),
    GGUFValueType.FLOAT32: ("f", 4), GGUFValueType.UINT64: ("Q", 8), GGUFValueType.INT64: ("q", 8),
    GGUFValueType.FLOAT64: ("d", 8), GGUFValueType.BOOL: ("?", 1),
}


class CompactField(NamedTuple):
    """A metadata array as one list: `contents()` returns it (gguf-py's ReaderField.contents())."""

    offset: int
    name: str
    values: list[Any]
    types: list[GGUFValueType]
    parts: list[Any] = []  # nothing to add up: fields are pushed with skip_sum

    @property
    def data(self) -> range:
        """One entry per element (what len() of a ReaderField's data gives)."""
        return range(len(self.values))

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        return self.values[index_or_slice]


class CompactGGUFReader(GGUFReader):
    """gguf.GGUFReader with metadata arrays parsed into plain lists (module docstring)."""

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I":
            return super()._build_fields(offs, count)
        buf = self.data.data  # the memmap's memoryview: no copy
        for _ in range(int(count)):
            start = offs
            (key_len,) = struct.unpack_from("<Q", buf, offs)
            key = bytes(buf[offs + 8:offs + 8 + key_len]).decode("utf-8")
            offs += 8 + key_len
            (raw_type,) = struct.unpack_from("<I", buf, offs)
            offs += 4
            if raw_type == GGUFValueType.ARRAY:
                (item_type,) = struct.unpack_from("<I", buf, offs)
                if item_type == GGUFValueType.STRING or GGUFValueType(item_type) in _SCALARS:
                    (length,) = struct.unpack_from("<Q", buf, offs + 4)
                    values, end = _array(buf, offs + 12, GGUFValueType(item_type), length)
                    field = CompactField(start, key, values, [GGUFValueType.ARRAY, GGUFValueType(item_type)])
                    # a CompactField stands in for a ReaderField (same contents() / types / data; module doc)
                    self._push_field(field, skip_sum=True)  # type: ignore[arg-type]
                    offs = end
                    continue
            size, parts, idxs, types = self._get_field_parts(offs, raw_type)  # scalars, strings, nested arrays
            head: list[np.ndarray] = [np.array([key_len], np.uint64), np.frombuffer(key.encode(), np.uint8),
                                      np.array([raw_type], np.uint32)]
            self._push_field(self._reader_field(start, key, head + parts, [i + 3 for i in idxs], types), skip_sum=True)
            offs += size
        return offs

    @staticmethod
    def _reader_field(offset: int, name: str, parts: list[np.ndarray], data: list[int],
                      types: list[GGUFValueType]) -> ReaderField:
        """gguf-py's own field for what `_build_fields` leaves to its parser (scalars, strings, nested arrays)."""
        return ReaderField(offset, name, parts, data, types)


def _array(buf: memoryview, offs: int, item: GGUFValueType, length: int) -> tuple[list[Any], int]:
    """`length` elements of type `item` from offset `offs`: (values, offset after them). ValueError
    when the array runs past the end of the file."""
    if item == GGUFValueType.STRING:
        values: list[Any] = []
        for _ in range(length):
            (n,) = struct.unpack_from("<Q", buf, offs)
            if offs + 8 + n > len(buf):
                raise ValueError(f"string array element at offset {offs} runs past the end of the file")
            values.append(bytes(buf[offs + 8:offs + 8 + n]).decode("utf-8"))
            offs += 8 + n
        return values, offs
    code, size = _SCALARS[item]
    end = offs + size * length
    if end > len(buf):
        raise ValueError(f"array of {length} {item.name} at offset {offs} runs past the end of the file")
    return list(struct.unpack_from(f"<{length}{code}", buf, offs)), end
