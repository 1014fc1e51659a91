"""Request bodies a hostile or broken client sends to /v1/chat/completions and /v1/completions: JSON-shaped
garbage from a seed, each invalid by construction (so the server must answer 4xx, never 2xx or 5xx).

    kinds   not an object; a field of the wrong type; a number out of range (huge, negative, a float where an
            integer goes, a 5,000-digit integer); deep nesting; a long string where a bounded one goes; invalid
            Unicode (a lone surrogate escape, bytes that are not UTF-8); an unknown field; a missing one;
            truncated JSON.

`hostile_bodies(seed, count)` yields (name, path, raw bytes).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
NUMERIC = {  # field -> values that are out of its range (every one must be refused)
    "max_tokens": [0, -1, 2**31, 10**30, 1.5, "8", True],
    "n": [0, 129, -3, 10**20, 2.5],
    "temperature": [-0.1, 2.5, 1e308, "hot", [1]],
    "top_p": [0, -1, 1.0001, 1e300],
    "top_k": [-2, 2**31, 10**100],
    "seed": [2**64, 2**63, -(2**63) - 1, 10**50, 0.5, "s"],
    "presence_penalty": [2.01, -2.01, 1e30],
    "frequency_penalty": [3, -3, -1e30],
    "repetition_penalty": [0, -1, 1e6, 1e308],
    "min_tokens": [-1, 2**31, 10**40],
    "logprobs": [-1, 21, 10**9],
    "max_attention_window": [0, -5, 2**40],
    "sink_token_length": [-1, 2**40],
}
WRONG_TYPES = [None, True, 3, 3.5, "text", [], [1, "a"], {}, {"a": {"b": []}}]
TYPED = {  # field -> a predicate saying a value is acceptable (wrong types are the ones it refuses)
    "model": lambda v: isinstance(v, str),
    "stream": lambda v: isinstance(v, bool),
    "stop": lambda v: v is None or isinstance(v, str) and v != "" or isinstance(v, list) and all(
        isinstance(x, str) and x for x in v),
    "logit_bias": lambda v: v is None or v == {},
    "ignore_eos": lambda v: isinstance(v, bool),
    "user": lambda v: v is None or isinstance(v, str),
}


def _base(path: str) -> dict:
    if path == CHAT:
        return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


def _nested(depth: int, rng: random.Random) -> str:
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    return opener * depth + "1" + closer * depth


def _one(rng: random.Random) -> tuple[str, str, bytes]:
    """One invalid body: (kind, path, raw)."""
    path = rng.choice([CHAT, COMP])
    body = _base(path)
    kind = rng.choice(["not object", "numeric", "wrong type", "nesting", "long string", "surrogate", "bad utf8",
                       "unknown field", "missing", "truncated", "bad message", "bad prompt"])
    if kind == "not object":
        value = rng.choice([[1, 2], "x" * rng.randint(0, 50), 12, 1.5, None, True, [body]])
        return kind, path, json.dumps(value).encode()
    if kind == "numeric":
        field = rng.choice(list(NUMERIC))
        body[field] = rng.choice(NUMERIC[field])
    elif kind == "wrong type":
        field = rng.choice(list(TYPED))
        body[field] = rng.choice([v for v in WRONG_TYPES if not TYPED[field](v)])
    elif kind == "nesting":
        raw = json.dumps(body)
        field = rng.choice(["metadata", "logit_bias", "stop", "user"])
        return kind, path, (raw[:-1] + f', "{field}": ' + _nested(rng.choice([50, 2000, 30000]), rng) + "}").encode()
    elif kind == "long string":
        field = rng.choice(["model", "user", "stop"])  # over 512 characters (a name), 4096 (a stop string)
        body[field] = "x" * rng.choice([5000, 100_000] if field == "stop" else [600, 5000, 100_000])
    elif kind == "surrogate":
        raw = json.dumps(body)
        target = '"Hi"' if path == CHAT else '"Hello"'
        return kind, path, raw.replace(target, rng.choice(['"\\ud800"', '"a\\udfffb"', '"\\ud83d x"'])).encode()
    elif kind == "bad utf8":
        return kind, path, json.dumps(body).encode().replace(b"H", rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"]))
    elif kind == "unknown field":
        body["".join(rng.choice("abcdefgh_") for _ in range(rng.randint(3, 12))) + "_x"] = rng.choice(WRONG_TYPES)
    elif kind == "missing":
        del body[rng.choice(["model", "messages" if path == CHAT else "prompt"])]
    elif kind == "truncated":
        raw = json.dumps(body).encode()
        return kind, path, raw[: rng.randint(0, len(raw) - 1)]
    elif kind == "bad message":
        body = _base(CHAT)
        path = CHAT
        body["messages"] = rng.choice([[], [{}], [{"role": "king", "content": "x"}], [{"role": "user", "content": 5}],
                                       [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                                       [{"role": "user", "content": [{"type": ["text"]}]}], "hi", [["user", "hi"]]])
    elif kind == "bad prompt":
        body = _base(COMP)
        path = COMP
        body["prompt"] = rng.choice([[], [[]], [-1, 5], [2**40], [1.5], {"text": "x"}, None, [["a"]], 5])
    return kind, path, json.dumps(body).encode()


def hostile_bodies(seed: int, count: int) -> Iterator[tuple[str, str, bytes]]:
    """`count` invalid bodies drawn from `seed` (the same ones for the same seed)."""
    rng = random.Random(seed)
    for _ in range(count):
        yield _one(rng)
