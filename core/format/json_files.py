"""Reading a user's JSON (config.json, tokenizer_config.json, ...): every way it can be wrong is one line.

Python's json parses text that is valid JSON yet unusable: nesting deep enough to exhaust the recursion
limit (RecursionError) and `\\ud800` escapes that decode to lone surrogates, strings no UTF-8 writer or
Rust library (tokenizers) accepts. Both are refused here, naming the file (and the key), as are bytes
that are not UTF-8 and text that is not JSON.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bestiary.core.format.errors import ConfigError

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the only way a lone surrogate gets into UTF-8 JSON text
_SURROGATE = re.compile("[\ud800-\udfff]")


def _printable(path: str) -> str:
    """`path` with its surrogates as \\udXXX escapes (it may hold one, and stderr must encode it)."""
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate_key(data: Any) -> str | None:
    """The key path ('a.b[2]') of the first key or string value holding a lone surrogate, else None
    ('<root>' for a top-level string); iterative, so any depth json accepted is walked."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return _printable(path) or "<root>"
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return _printable(child)
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def parse_json(text: str, source: str) -> Any:
    """The values of JSON `text` read from `source`; malformed JSON, nesting too deep to parse and strings
    with lone surrogates are a one-line ConfigError naming `source`."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{source}: not valid JSON (nested too deeply to read)") from None
    except ValueError as err:  # json.JSONDecodeError, and int strings past Python's digit limit
        raise ConfigError(f"{source}: not valid JSON ({str(err).splitlines()[0][:200]})") from None
    if _SURROGATE_ESCAPE.search(text):
        key = lone_surrogate_key(data)
        if key is not None:
            raise ConfigError(f"{source}: field '{key}': a lone surrogate escape (\\ud800-\\udfff without its "
                              "pair) is not text; write the character itself or its full surrogate pair")
    return data


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in file `path`, with one-line errors for a missing, non-UTF-8 or malformed file
    or one whose top level is not an object."""
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON (not UTF-8: byte 0x{err.object[err.start]:02x} at offset "
                          f"{err.start})") from None
    data = parse_json(text, str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
