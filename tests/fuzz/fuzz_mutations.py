"""Mutations shared by the input kinds: hostile JSON values, byte-level damage, JSON text damage, and a
JSON tree edit at any depth. Every function takes the case's random.Random and returns (what, result),
`what` a short description that the failure report prints."""

from __future__ import annotations

import json
import random
from typing import Any

# Bytes no JSON text may hold outside a string (control characters, bytes never valid in UTF-8).
BAD_JSON_BYTES = [*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x80, 0xC2), *range(0xF5, 0x100)]


def nested(depth: int, kind: str = "list") -> Any:
    """A value nested `depth` levels deep: [[[...]]] or {"a": {"a": ...}}."""
    value: Any = []
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def hostile_value(rng: random.Random) -> tuple[str, Any]:
    """A JSON value of a wrong type, range or size for almost any config key."""
    choices: list[tuple[str, Any]] = [
        ("true", True), ("false", False), ("null", None), ("-1", -1), ("0", 0), ("1", 1), ("1e308", 1e308),
        ("-1e308", -1e308), ("2**63", 2**63), ("2**64+1", 2**64 + 1), ("10**30", 10**30), ("-2**31", -(2**31)),
        ("0.5", 0.5), ("1.5", 1.5), ("-0.0", -0.0), ("NaN", float("nan")), ("Infinity", float("inf")),
        ("-Infinity", float("-inf")), ('""', ""), ('"x"', "x"), ('"12"', "12"), ('"-1"', "-1"),
        ("nested list 150", nested(150)), ("nested dict 150", nested(150, "dict")), ("[1]", [1]), ("[]", []),
        ("{}", {}), ('{"a": 1}', {"a": 1}), ("[true, null]", [True, None]), ("list of 10000", [1] * 10000),
        ("1 MB string", "x" * 2**20), ("unicode", "\u202e\u0000é\U0001f600\ufeff"), ("lone surrogate", "\ud800"),
        ('"None"', "None"), ('"[1]"', "[1]"), ('{"type": 1}', {"type": 1}), ('{"rope_type": "x"}', {"rope_type": "x"}),
    ]
    return rng.choice(choices)


def dumps(value: Any) -> bytes:
    """JSON text of `value` (NaN/Infinity as Python writes them; a lone surrogate escaped)."""
    return json.dumps(value, indent=1).encode()


def damage_bytes(rng: random.Random, data: bytes, protect: int = 0) -> tuple[str, bytes]:
    """Bytes damaged one way: bits flipped, cut, a chunk inserted, zeroed or repeated, or junk instead."""
    n = len(data)
    op = rng.randrange(7)
    if op == 0 and n:
        out = bytearray(data)
        flips = rng.choice([1, 2, 8, 64])
        for _ in range(flips):
            pos = rng.randrange(protect, n) if n > protect else rng.randrange(n)
            out[pos] ^= 1 << rng.randrange(8)
        return f"{flips} bit(s) flipped", bytes(out)
    if op == 1:
        cut = rng.randrange(0, max(1, n))
        return f"truncated at {cut} of {n}", data[:cut]
    if op == 2:
        pos, junk = rng.randrange(0, n + 1), rng.randbytes(rng.choice([1, 7, 100, 4096]))
        return f"{len(junk)} bytes inserted at {pos}", data[:pos] + junk + data[pos:]
    if op == 3 and n:
        pos = rng.randrange(n)
        size = rng.choice([1, 8, 64, 1024])
        return f"{size} bytes zeroed at {pos}", data[:pos] + bytes(min(size, n - pos)) + data[pos + size :]
    if op == 4 and n:
        pos = rng.randrange(n)
        chunk = data[pos : pos + rng.choice([16, 256, 4096])]
        return f"{len(chunk)} bytes at {pos} repeated", data[:pos] + chunk + data[pos:]
    if op == 5:
        return "empty file", b""
    junk = rng.randbytes(rng.choice([1, 8, 100, 10000]))
    return f"{len(junk)} random bytes", junk


def damage_json_text(rng: random.Random, text: bytes) -> tuple[str, bytes]:
    """JSON text no reader accepts as an object: cut, a byte JSON never allows, another top-level value, junk."""
    op = rng.randrange(5)
    if op == 0:
        cut = rng.randrange(0, max(1, len(text.rstrip()) - 1))
        return f"JSON cut at {cut}", text[:cut]
    if op == 1:
        pos = rng.randrange(len(text))
        return f"JSON byte {pos} not JSON", text[:pos] + bytes([rng.choice(BAD_JSON_BYTES)]) + text[pos + 1 :]
    if op == 2:
        other = rng.choice(["[]", "[1, 2]", "12", '"text"', "null", "true", "1e999", "[" * 100000])
        return f"top level {other[:20]!r}", other.encode()
    if op == 3:
        return "UTF-16 text", text.decode("utf-8", "replace").encode("utf-16")
    return damage_bytes(rng, text)


def paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a JSON tree (dict keys and list indices; lists sampled to their first 3 items)."""
    out: list[tuple] = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree[:3]) if isinstance(tree, list) else []
    for key, value in items:
        out.append((*prefix, key))
        out.extend(paths(value, (*prefix, key)))
    return out


def edit_tree(rng: random.Random, tree: Any, path: tuple | None = None,
              value: tuple[str, Any] | None = None) -> tuple[str, Any]:
    """A copy of `tree` with one key path (random unless given) set to a hostile value, or deleted."""
    tree = json.loads(json.dumps(tree))
    every = paths(tree)
    if not every:
        return "whole tree replaced", hostile_value(rng)[1]
    path = path or rng.choice(every)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    name = ".".join(map(str, path))
    if value is None and rng.random() < 0.15:
        del parent[path[-1]]
        return f"{name} deleted", tree
    what, parent[path[-1]] = value or hostile_value(rng)
    return f"{name} = {what}", tree


def set_key(tree: dict, key: str, rng: random.Random) -> tuple[str, dict]:
    """A copy of the dict `tree` with `key` (added if absent) set to a hostile value."""
    tree = json.loads(json.dumps(tree))
    what, tree[key] = hostile_value(rng)
    return f"{key} = {what}", tree
