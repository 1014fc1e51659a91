"""core.format.safetensors_stream: export's plain-read .safetensors reader validates the whole header when
the file is opened, so each corruption the fuzzer found is one WeightsError line naming the file and tensor."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bestiary.core.format.errors import WeightsError
from bestiary.core.format.safetensors_stream import MAX_HEADER_BYTES, SafetensorsStream

TENSORS = {
    "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b.scale": torch.tensor(2.5, dtype=torch.bfloat16),  # 0-dim
    "c.empty": torch.empty(0, 5, dtype=torch.float16),
    "d.mask": torch.tensor([True, False, True]),
    "e.codes": torch.tensor([[-3, 7]], dtype=torch.int8),
}


def _split(path: Path) -> tuple[dict, bytes]:
    """(header object, data section) of a .safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(path: Path, header: dict | bytes, data: bytes, length: int | None = None) -> Path:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "rank0.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    return path


def test_reads_every_tensor_exactly(good: Path) -> None:
    with SafetensorsStream(good) as f:
        assert sorted(f.keys()) == sorted(TENSORS)
        for key, want in TENSORS.items():
            got = f.get_tensor(key)
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), key


def _error(path: Path) -> str:
    with pytest.raises(WeightsError) as info:
        SafetensorsStream(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


@pytest.mark.parametrize(("length", "expect"), [
    (0, "header length 0 does not fit"),  # was JSONDecodeError
    (2 ** 63, "header length 9223372036854775808 does not fit"),  # was OverflowError
    (2 ** 40, "header length 1099511627776 does not fit"),  # was a 1 TB read: "out of memory", exit 1
    (2 ** 64 - 1, "does not fit"),
])
def test_header_length_is_bounded_by_the_file(good: Path, length: int, expect: str) -> None:
    header, data = _split(good)
    assert expect in _error(_join(good, header, data, length))


def test_header_length_over_safetensors_limit(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(MAX_HEADER_BYTES + 100)  # sparse: the length fits the file, the limit refuses it unread
    assert "over the 100000000-byte limit" in _error(path)


@pytest.mark.parametrize(("blob", "expect"), [
    (b'{"a": \xff}', "header is not UTF-8 text (byte 0xff at offset 14)"),
    (b'{"a": ', "header is not valid JSON"),
    (b"[" * 100000 + b"]" * 100000, "header is not valid JSON"),  # RecursionError in json
    (b'{"a": ' + b"9" * 5000 + b"}", "header is not valid JSON"),  # int over sys.get_int_max_str_digits
    (b"[1, 2]", "header is a JSON list; expected an object"),
])
def test_header_must_be_a_json_object(tmp_path: Path, blob: bytes, expect: str) -> None:
    assert expect in _error(_join(tmp_path / "x.safetensors", blob, b""))


def test_too_short_for_a_header_length(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02")
    assert "expected an 8-byte header length" in _error(path)


@pytest.mark.parametrize(("field", "value", "expect"), [
    ("dtype", "", "tensor 'a.weight': dtype ''; expected one of F32"),  # was KeyError ''
    ("dtype", None, "dtype None"),
    ("dtype", "F64", "dtype 'F64'"),
    ("shape", [], "data_offsets [0, 48] span 48 bytes; F32 [] needs 4"),  # was a reshape RuntimeError
    ("shape", [3, -4], "shape [3, -4]; expected a list of non-negative integers"),
    ("shape", [3, True, 4], "shape [3, True, 4]"),
    ("shape", [3.0, 4], "shape [3.0, 4]"),
    ("shape", "3x4", "shape '3x4'"),
    ("shape", [2 ** 62, 2 ** 62], "needs"),
    ("data_offsets", [48, 0], "data_offsets [48, 0]; expected [start, end] with 0 <= start <= end"),
    ("data_offsets", [-8, 40], "data_offsets [-8, 40]"),  # was "read length must be non-negative"
    ("data_offsets", [0], "data_offsets [0]; expected [start, end] (two integers)"),
    ("data_offsets", [0, 10 ** 9], "data_offsets [0, 1000000000] end past the data section's"),
    ("data_offsets", [0, 44], "span 44 bytes; F32 [3, 4] needs 48"),  # was frombuffer's buffer-length ValueError
])
def test_each_entry_is_validated(good: Path, field: str, value: object, expect: str) -> None:
    header, data = _split(good)
    header["a.weight"][field] = value
    message = _error(_join(good, header, data))
    assert "tensor 'a.weight'" in message and expect in message


def test_entry_that_is_not_an_object(good: Path) -> None:
    header, data = _split(good)
    header["a.weight"] = [1, 2]
    assert "tensor 'a.weight': header entry [1, 2]; expected an object" in _error(_join(good, header, data))


def test_truncated_file_is_refused_when_opened(good: Path) -> None:
    raw = good.read_bytes()
    good.write_bytes(raw[:len(raw) - 7])  # was a reshape RuntimeError on the last tensor read
    assert "end past the data section's" in _error(good) and "truncated" in _error(good)


def test_file_cut_short_after_it_was_opened(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    save_file({"big": torch.zeros(1 << 16)}, str(path))  # larger than what the open file has buffered
    with SafetensorsStream(path) as f:
        with open(path, "r+b") as w:
            w.truncate(f.entries["big"].start + 1)
        with pytest.raises(WeightsError, match=r"tensor 'big': file ends \d+ bytes early"):
            f.get_tensor("big")


def test_a_bad_header_closes_the_file(good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = []
    real_open = open

    def tracking_open(*args, **kwargs):  # type: ignore[no-untyped-def]
        handle = real_open(*args, **kwargs)
        opened.append(handle)
        return handle

    monkeypatch.setattr("builtins.open", tracking_open)
    header, data = _split(good)
    header["a.weight"]["dtype"] = ""
    _error(_join(good, header, data))
    assert opened and all(h.closed for h in opened)


def _two(a: list[int], b: list[int]) -> dict:
    return {"x": {"dtype": "F32", "shape": [2], "data_offsets": a}, "y": {"dtype": "F32", "shape": [2], "data_offsets": b}}


@pytest.mark.parametrize(("header", "size", "expect"), [
    (_two([0, 8], [0, 8]), 16, "tensor 'y': data_offsets start at 0, which overlaps the tensor before it (expected 8)"),
    (_two([0, 8], [4, 12]), 12, "tensor 'y': data_offsets start at 4, which overlaps the tensor before it (expected 8)"),
    (_two([0, 8], [12, 20]), 20, "tensor 'y': data_offsets start at 12, which leaves a gap before it (expected 8)"),
    (_two([0, 8], [8, 16]), 24, "the tensors end at byte 16 of a 24-byte data section"),
])
def test_tensors_must_tile_the_data_section(tmp_path: Path, header: dict, size: int, expect: str) -> None:
    """Two tensors sharing bytes (an engine loaded them as silently wrong weights: load_file refused them, the
    plain reader did not), a gap, or bytes past the last tensor: one line naming the file and the tensor."""
    assert expect in _error(_join(tmp_path / "bad.safetensors", header, bytes(size)))


def test_tensors_are_read_64_byte_aligned(good: Path) -> None:
    """Kernels use loaded tensors as they are (int8 weights -> aten._weight_int8pack_mm crashed at 8-byte offsets)."""
    with SafetensorsStream(good) as f:
        assert all(f.get_tensor(k).data_ptr() % 64 == 0 for k in f.keys() if f.entries[k].nbytes)
