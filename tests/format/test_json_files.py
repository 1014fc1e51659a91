"""core.format.json_files and config.json's shape (config_sections, config_mapping): one-line ConfigErrors."""

from __future__ import annotations

import json

import pytest

from bestiary.core.format.config import Mapping, config_mapping, config_sections, validate_config
from bestiary.core.format.errors import ConfigError
from bestiary.core.format.json_files import lone_surrogate_key, parse_json, read_json


@pytest.mark.parametrize("text,words", [
    ("[" * 100_000 + "]" * 100_000, ["x.json: not valid JSON (nested too deeply to read)"]),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, ["nested too deeply"]),
    ('{"a": 1', ["x.json: not valid JSON", "delimiter"]),
    ('{"bos_token": "\\ud800"}', ["x.json: field 'bos_token'", "lone surrogate"]),
    ('{"a": [0, {"b": "x\\udfffy"}]}', ["field 'a[1].b'", "lone surrogate"]),
    ('{"k\\udc80": 1}', ["field 'k\\udc80'", "lone surrogate"]),
    ('"\\ud800"', ["field '<root>'"]),
])
def test_parse_json_errors_are_one_line(text, words):
    with pytest.raises(ConfigError) as info:
        parse_json(text, "x.json")
    message = str(info.value)
    assert len(message.splitlines()) == 1
    message.encode("utf-8")  # printable: no surrogate of the input in it
    for word in words:
        assert word in message


def test_parse_json_keeps_surrogate_pairs_and_escaped_backslashes():
    assert parse_json('{"e": "\\ud83d\\ude00", "b": "\\\\ud800"}', "x.json") == {"e": "\U0001F600", "b": "\\ud800"}
    deep = json.loads("[" * 500 + "]" * 500)
    assert lone_surrogate_key(deep) is None  # walked without recursion


def test_read_json(tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(ConfigError, match="file not found"):
        read_json(path)
    path.write_bytes(b'{"a": "caf\xe9"}')
    with pytest.raises(ConfigError, match=r"not UTF-8: byte 0xe9 at offset 10"):
        read_json(path)
    path.write_text("[1]")
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        read_json(path)
    path.write_text('{"a": "\u00e9"}', encoding="utf-8")
    assert read_json(path) == {"a": "\u00e9"}


def test_config_sections():
    assert config_sections({"architecture": "X"}, "c.json") == ({"architecture": "X"}, None)
    assert config_sections({"pretrained_config": {"a": 1}}, "c.json") == ({"a": 1}, {})
    for data, field in (({"pretrained_config": 0.5}, "pretrained_config"),
                        ({"pretrained_config": {}, "build_config": float("nan")}, "build_config")):
        with pytest.raises(ConfigError, match=f"c.json: field '{field}': expected a JSON object"):
            config_sections(data, "c.json")


@pytest.mark.parametrize("value", [0.5, 2.0, "2", [1], True, 0, None])
def test_mapping_sizes_are_strict(value):
    for data, field in (({"mapping": {"tp_size": value}}, "mapping.tp_size"),
                        ({"pretrained_config": {"mapping": {"pp_size": value}}}, "pretrained_config.mapping.pp_size")):
        with pytest.raises(ConfigError, match=f"c.json: field '{field}'"):
            config_mapping(data, "c.json")


def test_mapping_defaults_and_non_object():
    assert config_mapping({}, "c.json").tp_size == 1
    assert config_mapping({"mapping": {"tp_size": 2, "pp_size": 2}}, "c.json").world_size == 4
    with pytest.raises(ConfigError, match="field 'mapping': expected a JSON object, got list"):
        config_mapping({"mapping": [2]}, "c.json")
    with pytest.raises(ConfigError, match="field 'mapping': expected a JSON object, got NoneType"):
        config_mapping({"mapping": None}, "c.json")
    with pytest.raises(ConfigError, match="field '<root>'"):
        validate_config(Mapping, 5, "c.json")  # type: ignore[arg-type]
