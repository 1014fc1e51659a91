"""Structured output is valid (core.runtime.guided): JSON schemas generated from a seed, regexes, Lark and
GBNF grammars and choices, run greedy and sampled in one in-flight batch; every output that ends "stop"
is judged outside the engine (json.loads + jsonschema, Python `re`, a recursive-descent parser).

The slow test runs >= 200 generated schemas (x greedy and sampled) on SmolLM2-135M (float32: the
session's checkpoint, built here with a larger batch); the fast one runs a handful of each kind on a tiny
random LLaMA with a byte-level BPE tokenizer (tests/helpers/tiny_chat.py), whose outputs are a random
walk through the grammar. Run as a script, the slow test's counts and wall time are printed:
    python tests/runtime/test_guided_validity.py [--schemas 200]
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema")

from bestiary.core.runtime.guided import GuidedConfig  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

WORDS = ["name", "city", "color", "size", "score", "label", "kind", "count", "price", "title", "tags", "owner",
         "status", "level", "note", "code", "year", "rate", "flag", "unit", "mode", "rank", "team", "host"]
VALUES = ["red", "green", "blue", "small", "large", "alpha", "beta", "on", "off", "north", "south", "cat", "dog"]
TOPICS = ["a book", "a city", "a user account", "a product", "a weather report", "a football team", "a recipe",
          "a server", "a planet", "a car", "a movie", "an employee"]
MAX_TOKENS = 400


# ----------------------------------------------------------------------------- the schema generator

def scalar(rng: random.Random) -> dict[str, Any]:
    """A bounded leaf: strings bounded by maxLength, numbers and integers by minimum / maximum."""
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "const", "nullable"])
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": rng.randint(max(low, 1), 20)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        out: dict[str, Any] = {"type": "integer", "minimum": low, "maximum": low + rng.choice([1, 9, 50, 1000])}
        if rng.random() < 0.3:
            out["exclusiveMinimum"] = out.pop("minimum")
            out["maximum"] += 1
        return out
    if kind == "number":
        low = rng.choice([-1000.0, -1.5, 0.0, 0.25, 10.0])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1.0, 100.0, 5000.0])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        pool: list[Any] = VALUES + [1, 2, 3, 42, None, True]
        return {"enum": rng.sample(pool, rng.randint(1, 5))}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, False, None, "v1.0"])}
    inner = scalar(rng)
    while not isinstance(inner.get("type"), str):  # a typed leaf (not an enum, const or nullable one)
        inner = scalar(rng)
    return {**inner, "type": [inner["type"], "null"]}


def schema_of(rng: random.Random, depth: int) -> dict[str, Any]:
    """A value schema: leaves, anyOf, arrays (minItems / maxItems) and objects, nested to `depth`."""
    kinds = ["scalar"] * 5 + ["anyOf"] + (["array", "object"] if depth > 0 else [])
    kind = rng.choice(kinds)
    if kind == "scalar":
        return scalar(rng)
    if kind == "anyOf":
        return {"anyOf": [scalar(rng) for _ in range(rng.randint(2, 3))]}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": schema_of(rng, depth - 1), "minItems": low, "maxItems": low + rng.randint(1, 3)}
    return object_schema(rng, depth - 1)


def object_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    """An object of 1-5 properties (a random subset required; no additional properties)."""
    names = rng.sample(WORDS, rng.randint(1, 5 if depth > 0 else 3))
    required = [n for n in names if rng.random() < 0.75] or names[:1]
    return {"type": "object", "properties": {n: schema_of(rng, depth) for n in names}, "required": required,
            "additionalProperties": False}


def generated_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` JSON schemas (objects nested up to 3 levels), the same for the same seed."""
    rng = random.Random(seed)
    return [object_schema(rng, rng.randint(0, 2)) for _ in range(count)]


# ----------------------------------------------------------------------------- the other kinds and their judges

REGEXES = [
    r"\d{3}-\d{3}-\d{4}",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"[a-z]{1,10}@[a-z]{1,8}\.(com|org|net)",
    r"#[0-9a-f]{6}",
    r"(yes|no|maybe)",
    r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    r"[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12}){0,2}",
    r"-?(0|[1-9]\d{0,5})(\.\d{1,3})?",
]

ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term){0,4}
term: factor (("*" | "/") factor){0,3}
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,4}/
"""
ARITH_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,4}
term ::= factor (("*" | "/") factor){0,3}
factor ::= [0-9]{1,4} | "(" expr ")"
"""
KEYVALUE_GBNF = r"""
root ::= pair ("\n" pair){0,4}
pair ::= key "=" value
key ::= [a-z] [a-z_]{0,9}
value ::= [a-zA-Z0-9.]{1,12}
"""
CSV_LARK = r"""
start: row ("\n" row){1,4}
row: FIELD ("," FIELD){1,3}
FIELD: /[A-Za-z0-9 ]{1,12}/
"""
KEYVALUE_RE = re.compile(r"[a-z][a-z_]{0,9}=[a-zA-Z0-9.]{1,12}(\n[a-z][a-z_]{0,9}=[a-zA-Z0-9.]{1,12}){0,4}")
CSV_RE = re.compile(r"[A-Za-z0-9 ]{1,12}(,[A-Za-z0-9 ]{1,12}){1,3}(\n[A-Za-z0-9 ]{1,12}(,[A-Za-z0-9 ]{1,12}){1,3}){1,4}")
CHOICES = [["positive", "negative", "neutral"], ["Paris", "London", "Berlin", "Madrid"], ["A", "B", "C", "D"]]


class Arithmetic:
    """A recursive-descent parser of ARITH_LARK / ARITH_GBNF's language:
    expr = term (op term){0,4}; term = factor (op factor){0,3}; factor = [0-9]{1,4} | '(' expr ')'."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def parse(self) -> bool:
        try:
            self.expr()
        except ValueError:
            return False
        return self.pos == len(self.text)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expr(self) -> None:
        self.term()
        for _ in range(4):
            if self.peek() not in ("+", "-") or not self.peek():
                return
            self.pos += 1
            self.term()

    def term(self) -> None:
        self.factor()
        for _ in range(3):
            if self.peek() not in ("*", "/") or not self.peek():
                return
            self.pos += 1
            self.factor()

    def factor(self) -> None:
        if self.peek() == "(":
            self.pos += 1
            self.expr()
            if self.peek() != ")":
                raise ValueError(f"')' expected at {self.pos}")
            self.pos += 1
            return
        digits = re.match(r"[0-9]{1,4}", self.text[self.pos:])
        if digits is None:
            raise ValueError(f"a number expected at {self.pos}")
        self.pos += digits.end()


@dataclass
class Case:
    """One request: its constraint, prompt and judge (text -> None when valid, else why not)."""

    label: str
    guided: GuidedConfig
    prompt: str
    judge: Any
    schema: dict[str, Any] | None = None


def judge_json(schema: dict[str, Any]):
    validator = jsonschema.Draft202012Validator(schema)

    def judge(text: str) -> str | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            return f"not JSON: {err}"
        errors = [e.message for e in validator.iter_errors(value)]
        return "; ".join(errors) or None
    return judge


def judge_regex(pattern: str):
    compiled = re.compile(pattern)
    return lambda text: None if compiled.fullmatch(text) else f"does not fullmatch {pattern!r}"


def json_cases(schemas: list[dict[str, Any]], seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    return [Case(f"schema {i}", GuidedConfig(json_schema=s),
                 f"Reply with JSON only: {rng.choice(TOPICS)}, with the fields {', '.join(s['properties'])}.",
                 judge_json(s), s) for i, s in enumerate(schemas)]


def other_cases() -> list[Case]:
    """The regexes, the four grammars and the choices, each with its judge."""
    out = [Case(f"regex {p}", GuidedConfig(regex=p), "Give one example value, nothing else.", judge_regex(p))
           for p in REGEXES]
    arith = lambda text: None if Arithmetic(text).parse() else "not an arithmetic expression"  # noqa: E731
    out += [Case("lark arithmetic", GuidedConfig(grammar=ARITH_LARK), "Write an arithmetic expression.", arith),
            Case("gbnf arithmetic", GuidedConfig(grammar=ARITH_GBNF), "Write a sum of products.", arith),
            Case("gbnf key=value", GuidedConfig(grammar=KEYVALUE_GBNF), "Write a config file as key=value lines.",
                 judge_regex(KEYVALUE_RE.pattern)),
            Case("lark csv", GuidedConfig(grammar=CSV_LARK), "Write a small CSV table of fruits and prices.",
                 judge_regex(CSV_RE.pattern))]
    for choices in CHOICES:
        out.append(Case(f"choice {choices}", GuidedConfig(choice=choices), f"Pick one of {', '.join(choices)}.",
                        lambda text, c=tuple(choices): None if text in c else f"not one of {c}"))
    return out


# ----------------------------------------------------------------------------- running and counting

@dataclass
class Tally:
    """Counts of a run: finish reasons, valid outputs, the invalid ones (label, mode, text, why)."""

    finish: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)  # (kind, greedy | sampled, finish reason) -> requests
    valid: int = 0
    invalid: list[tuple[str, str, str, str]] = field(default_factory=list)
    lengths: list[tuple[str, str, str]] = field(default_factory=list)  # outputs that ran out of tokens
    tokens: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        total = sum(self.finish.values())
        return (f"{total} requests: stop {self.finish['stop']}, length {self.finish['length']}, "
                f"valid {self.valid} of {self.finish['stop']} stopped, invalid {len(self.invalid)}; "
                f"{self.tokens} tokens in {self.seconds:.1f} s")


def modes(seed: int) -> list[tuple[str, dict[str, Any]]]:
    """Greedy, and sampled with a temperature in [0.7, 1.0] and a seed."""
    rng = random.Random(seed)
    return [("greedy", {"temperature": 0.0}),
            ("sampled", {"temperature": round(rng.uniform(0.7, 1.0), 2), "random_seed": seed})]


def run_cases(llm: LLM, cases: list[Case], max_tokens: int = MAX_TOKENS, sampled: bool = True) -> Tally:
    """Every case greedy and (if asked) sampled, all in one LLM.generate call (in-flight batching)."""
    work = [(case, name, SamplingConfig(max_new_tokens=max_tokens, guided=case.guided, **options))
            for i, case in enumerate(cases) for name, options in modes(i)[: 2 if sampled else 1]]
    start = time.perf_counter()
    done = llm.generate([c.prompt for c, _, _ in work], [s for *_, s in work], chat=True)
    tally = Tally(seconds=time.perf_counter() - start)
    for (case, name, _), out in zip(work, done):
        tally.finish[out.finish_reason] += 1
        tally.by_kind[case.label.split()[0], name, out.finish_reason] += 1
        tally.tokens += len(out.output_ids)
        text = out.text or ""
        if out.finish_reason == "length":
            tally.lengths.append((case.label, name, text[-200:]))
            continue
        why = case.judge(text)
        if why is None:
            tally.valid += 1
        else:
            tally.invalid.append((case.label, name, text, why))
    return tally


def check(tally: Tally, max_length_share: float) -> None:
    assert not tally.invalid, f"{len(tally.invalid)} invalid outputs, e.g. {tally.invalid[:3]}"
    total = sum(tally.finish.values())
    assert set(tally.finish) <= {"stop", "length"}, tally.finish
    assert tally.finish["length"] <= max_length_share * total, f"{tally.line()}; e.g. {tally.lengths[:3]}"


# ----------------------------------------------------------------------------- the tests

def test_generated_schemas_are_valid_json_schemas():
    """The generator's schemas are themselves valid (Draft 2020-12), varied, and the same for a seed."""
    schemas = generated_schemas(200)
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
    text = json.dumps(schemas)
    for keyword in ("anyOf", "const", "enum", '"null"', "minItems", "maxItems", "exclusiveMinimum", "maxLength",
                    '"number"', '"integer"', '"boolean"'):
        assert keyword in text, keyword
    nested = sum(any(p.get("type") == "object" or p.get("type") == "array" for p in s["properties"].values())
                 for s in schemas)
    assert nested > 40
    assert generated_schemas(200) == schemas and generated_schemas(5, seed=1) != schemas[:5]


def test_judges_refuse_invalid_text():
    """The judges are not vacuous: each refuses a wrong output and accepts a right one."""
    assert Arithmetic("(12+3)*4-5/6").parse() and not Arithmetic("(12+3").parse() and not Arithmetic("1++2").parse()
    assert not Arithmetic("12345").parse() and not Arithmetic("").parse()
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}, "required": ["a"],
              "additionalProperties": False}
    judge = judge_json(schema)
    assert judge('{"a": 2}') is None and judge('{"a": 4}') and judge('{"a": 2, "b": 1}') and judge('{"a": 2')
    assert KEYVALUE_RE.fullmatch("port=8080\nhost=local.host") and not KEYVALUE_RE.fullmatch("port=")
    assert CSV_RE.fullmatch("apple,3\npear,4") and not CSV_RE.fullmatch("apple")


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_chat import make_tiny_chat_engine

    return LLM(make_tiny_chat_engine(tmp_path_factory.mktemp("guided_tiny"), max_batch_size=32, max_seq_len=256))


def test_tiny_model_outputs_are_valid(tiny_llm):
    """A handful of each kind on a random tiny model, greedy and sampled, in one batch: every output that
    stops is valid (a random model's walk through the grammar is a hard test of the masks)."""
    cases = json_cases(generated_schemas(8, seed=3)) + other_cases()
    tally = run_cases(tiny_llm, cases, max_tokens=160)
    print(tally.line())
    assert tally.finish["stop"] >= 0.7 * len(cases) * 2, tally.line()
    check(tally, max_length_share=0.3)


@pytest.fixture(scope="module")
def smol_llm(tmp_path_factory, smollm2_fp32_checkpoint):
    """SmolLM2-135M float32 (the session's checkpoint) built with room for 32 sequences of 400 new tokens."""
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine

    engine = build_engine(smollm2_fp32_checkpoint, tmp_path_factory.mktemp("guided_smol") / "engine",
                          BuildConfig(max_batch_size=32, max_seq_len=512))
    return LLM(engine)


@pytest.mark.slow
def test_smollm2_200_schemas_and_grammars_are_valid(smol_llm):
    """>= 200 generated schemas, the regexes, grammars and choices, greedy and sampled (400 new tokens at
    most), in one batch: 100% of stopped outputs valid, at most 1% "length"."""
    cases = json_cases(generated_schemas(200)) + other_cases()
    tally = run_cases(smol_llm, cases)
    print(tally.line())
    check(tally, max_length_share=0.01)


if __name__ == "__main__":
    import argparse
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--engine", required=True, help="a SmolLM2 engine dir (max_batch_size 32)")
    args = parser.parse_args()
    llm = LLM(args.engine)
    tally = run_cases(llm, json_cases(generated_schemas(args.schemas)) + other_cases())
    print(tally.line())
    print(dict(sorted(tally.by_kind.items())))
    for item in tally.invalid[:10] + tally.lengths[:10]:
        print(item)
    sys.exit(1 if tally.invalid else 0)
