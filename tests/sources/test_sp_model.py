"""sentencepiece `.model` parsing by hand (core.sources.sp_model): a field of the wrong wire type is a
one-line error naming the file, never a traceback or a huge allocation."""

from __future__ import annotations

import pytest

from bestiary.core.format.errors import BestiaryError
from bestiary.core.sources.sp_model import parse_sp_model, read_sp_model


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (payload under 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


def varint_field(number: int, value: int) -> bytes:
    """A varint protobuf field (value under 128)."""
    return bytes([number << 3, value])


def test_a_well_formed_piece_parses():
    model = parse_sp_model(field(1, field(1, b"ab") + varint_field(3, 1)))
    assert model.pieces == [("ab", 0.0, 1)]


@pytest.mark.parametrize("data", [
    field(1, varint_field(1, 5)),  # a piece whose text is a varint
    field(1, field(1, b"ab") + field(3, b"x")),  # a piece whose type is bytes
    varint_field(1, 5),  # the pieces field itself a varint
    field(1, field(1, b"ab")) + field(3, varint_field(2, 100)),  # precompiled_charsmap a varint (bytes(100))
    field(1, field(1, b"ab")) + field(2, field(3, b"x")),  # model_type bytes
], ids=["piece-text", "piece-type", "pieces", "charsmap", "model-type"])
def test_a_field_of_the_wrong_wire_type_is_a_one_line_error(tmp_path, data):
    with pytest.raises(ValueError, match="expected"):
        parse_sp_model(data)
    path = tmp_path / "tokenizer.model"
    path.write_bytes(data)
    with pytest.raises(BestiaryError, match="not a sentencepiece model"):
        read_sp_model(path)
