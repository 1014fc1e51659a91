"""Decode throughput of engines at a batch of sequences decoding together (issue 53: "batched decode at 32").

Each engine in turn (alternated rounds, each opened anew per round) gets `--batch` prompts of `--prompt`
tokens (different ids per sequence), one untimed warm-up generation, then one timed greedy generation of
`--tokens` new tokens each (EOS ignored). Decode tokens per second = batch x (tokens - 1) / (wall time -
time to the first tokens), the prefill taken out. Prints the median round per engine and its ratio to the
first engine.

    python benchmarks/batched_decode.py ENGINE_DIR [ENGINE_DIR ...] [--batch 32] [--prompt 64] [--tokens 64]
        [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time


def decode_rate(engine: str, batch: int, prompt: int, tokens: int, threads: int) -> float:
    """Decode tok/s of one freshly opened engine at `batch` sequences."""
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    llm = LLM(engine, num_threads=threads)
    prompts = [[100 + (7 * i + 13 * j) % 5000 for i in range(prompt)] for j in range(batch)]
    llm.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=4, ignore_eos=True))  # plans, pages
    start = time.perf_counter()
    llm.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=tokens, ignore_eos=True))
    wall = time.perf_counter() - start
    first = llm.last_stats.first_token_seconds
    del llm
    gc.collect()
    return batch * (tokens - 1) / (wall - first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", nargs="+", help="engine directories (the first is the ratios' reference)")
    parser.add_argument("--batch", type=int, default=32, help="sequences decoding together")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per sequence (timed)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (the median is printed)")
    parser.add_argument("--threads", type=int, default=2, help="kernel threads")
    args = parser.parse_args(argv)
    rates: dict[str, list[float]] = {e: [] for e in args.engines}
    print(f"load average {os.getloadavg()}, batch {args.batch}, prompt {args.prompt}, {args.tokens} new tokens")
    for _ in range(args.rounds):
        for engine in args.engines:
            rates[engine].append(decode_rate(engine, args.batch, args.prompt, args.tokens, args.threads))
    first = statistics.median(rates[args.engines[0]])
    print("| engine | decode tok/s (median) | rounds | vs first |\n|---|---|---|---|")
    for engine, r in rates.items():
        med = statistics.median(r)
        print(f"| {engine} | {med:.1f} | {', '.join(f'{v:.1f}' for v in r)} | {med / first:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
