"""Speculative decoding speed on input-grounded and open prompts: SmolLM2-135M-Instruct, batch 1, greedy;
plain vs prompt lookup (ngram) vs draft engines (the W4A16 and / or W8A16 builds of the same model, all in
the same rounds), each with the adaptive k (core.runtime.speculative_adaptive) and, with --fixed, with a fixed k as well.

Prompts (chat template, 6 of each by default):
  grounded: rewrite / repeat word for word / summarise quoting ~150-token passages of the built-in
            calibration text (core.bench.rewrite.source_texts) - the output copies the prompt;
  open:     short stories and explanations from a one-line request - nothing to copy.

Rounds alternate: round r runs every method over every prompt (the method order rotates each round);
a method's speed in a round is sum(generated - 1) / sum(time after the first token) over the prompt set
(GenerationStats.decode_tokens_per_second's definition, pooled), reported as the median over rounds,
and `x plain` is that median over plain's. Every method's outputs are compared with plain greedy
decoding's, token for token (the script exits 1 if any differs). Acceptance = accepted / drafted over
all rounds; `k chosen` counts the adaptive k's choices per step and sequence (0: a plain step).

    python benchmarks/speculative.py [--dtype float32] [--draft_quant W4A16 [W8A16]] [--draft_dtype bfloat16]
        [--new_tokens 96]
        [--rounds 3] [--prompts 6] [--ngram_k 8] [--draft_k 4] [--fixed] [--no_ngram] [--workdir DIR]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

GROUNDED = ["Rewrite the following text, keeping its meaning and wording, and fix any typos:\n\n",
            "Repeat the following text word for word:\n\n",
            "Summarise the following text, quoting its key sentences exactly:\n\n"]
OPEN = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Write a story about a dragon who is afraid of the dark.",
        "Explain why the sky is blue to a ten-year-old.",
        "Write a poem about autumn in a small village.",
        "Describe a day in the life of a city bus driver.",
        "Invent a recipe for a cake that a robot would love, and describe how to bake it.",
        "Write a letter from a cat to its owner about the new dog.",
        "Tell me a story about two friends lost in a forest."]


def engines(workdir: Path, dtype: str, draft_quant: str, draft_dtype: str | None = None) -> tuple[Path, Path]:
    """The target engine (dtype) and its draft engine (draft_quant, RTN, group 64, activations in draft_dtype,
    default dtype), built once under workdir."""
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.config import QuantConfig

    gguf, out = demo_model_path(), []
    draft_dtype = draft_dtype or dtype
    for name, dt, quant in ((dtype, dtype, None),
                            (f"{draft_dtype}-{draft_quant.lower()}", draft_dtype, QuantConfig(quant_algo=draft_quant))):
        ckpt, engine = workdir / f"{name}-ckpt", workdir / f"{name}-engine"
        if not (engine / "config.json").is_file():
            convert(gguf, ckpt, ConvertOptions(dtype=dt, quantization=quant, weight_quantizer="rtn" if quant else None),
                    show_progress=False)  # RTN: a draft needs speed, not the last bit
            build_engine(ckpt, engine, BuildConfig(max_batch_size=4, max_input_len=1024, max_seq_len=2048))
        out.append(engine)
    return out[0], out[1]


def prompt_sets(llm, count: int) -> dict[str, list[list[int]]]:
    """{"grounded": ids, "open": ids}: `count` chat prompts each."""
    from bestiary.core.bench.rewrite import source_texts

    texts = source_texts(llm.tokenizer, count, tokens=150)
    grounded = [GROUNDED[i % len(GROUNDED)] + texts[i] for i in range(count)]
    open_ = [OPEN[i % len(OPEN)] for i in range(count)]
    return {name: [llm.chat_ids([{"role": "user", "content": p}]) for p in prompts]
            for name, prompts in (("grounded", grounded), ("open", open_))}


@dataclass
class Tally:
    """One method on one prompt set: per round tok/s, outputs, counts."""

    rates: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # the last round's
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    k_chosen: dict[int, int] = field(default_factory=dict)


def run_set(llm, prompts: list[list[int]], sampling, tally: Tally) -> None:
    """One round of one method over one prompt set (batch 1, one prompt after the other)."""
    adaptive = getattr(llm.executor.speculator, "adaptive", None)  # None: plain, a fixed k (or code before it)
    before = dict(adaptive.choices) if adaptive is not None else {}
    tokens, seconds, outputs = 0, 0.0, []
    for ids in prompts:
        done = llm.generate([ids], sampling)[0]
        stats = llm.last_stats
        tokens += stats.generated_tokens - 1
        seconds += stats.seconds - (stats.first_token_seconds or 0.0)
        outputs.append(done.output_ids)
        if done.speculative is not None:
            tally.steps += done.speculative.steps
            tally.drafted += done.speculative.drafted
            tally.accepted += done.speculative.accepted
    tally.rates.append(tokens / seconds)
    tally.outputs = outputs
    if adaptive is not None:
        for k, n in adaptive.choices.items():
            tally.k_chosen[k] = tally.k_chosen.get(k, 0) + n - before.get(k, 0)


def methods(args, drafts: dict[str, Path]) -> dict[str, object]:
    """name -> SpeculativeConfig (None: plain); drafts: quant -> draft engine."""
    from bestiary.core.runtime.speculative import SpeculativeConfig

    out: dict[str, object] = {"plain": None}
    if not args.no_ngram:
        out[f"ngram k<={args.ngram_k}"] = SpeculativeConfig(method="ngram", num_draft_tokens=args.ngram_k)
    for quant, draft in drafts.items():
        out[f"draft {quant} k<={args.draft_k}"] = SpeculativeConfig(
            method="draft", num_draft_tokens=args.draft_k, draft_engine_dir=str(draft))
    if args.fixed:
        if not args.no_ngram:
            out[f"ngram k={args.ngram_k} fixed"] = SpeculativeConfig(method="ngram", num_draft_tokens=args.ngram_k,
                                                                     adaptive=False)
        for quant, draft in drafts.items():
            out[f"draft {quant} k={args.draft_k} fixed"] = SpeculativeConfig(
                method="draft", num_draft_tokens=args.draft_k, draft_engine_dir=str(draft), adaptive=False)
    return out


def measure(args) -> tuple[dict, dict[str, list[list[int]]]]:
    """(method -> set -> Tally, the prompt sets): every round runs every method over both sets."""
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    built = {quant: engines(Path(args.workdir), args.dtype, quant, args.draft_dtype) for quant in args.draft_quant}
    target = next(iter(built.values()))[0]
    configs = methods(args, {quant: pair[1] for quant, pair in built.items()})
    llms = {name: LLM(target, speculative=spec) for name, spec in configs.items()}
    sets = prompt_sets(llms["plain"], args.prompts)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0.0)
    for llm in llms.values():  # warm up: plans, draft caches, the first cost samples
        llm.generate([sets["grounded"][0]], SamplingConfig(max_new_tokens=16, temperature=0.0))
    tallies = {name: {s: Tally() for s in sets} for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            for s, prompts in sets.items():
                run_set(llms[name], prompts, sampling, tallies[name][s])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return tallies, sets


def report(args, tallies: dict, sets: dict) -> bool:
    """Print the table (and write --json); True when every output equals plain's."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"batch-1 greedy decode, {args.dtype} SmolLM2-135M-Instruct, {args.prompts} prompts per set, "
                        f"{args.new_tokens} new tokens, median of {args.rounds} alternated rounds")
    for col in ("method", "prompts", "tok/s", "x plain", "acceptance", "tokens / verify", "k chosen", "= plain"):
        table.add_column(col, justify="left" if col in ("method", "prompts", "k chosen") else "right")
    rows, same = [], True
    for name, by_set in tallies.items():
        for s, t in by_set.items():
            base = statistics.median(tallies["plain"][s].rates)
            rate = statistics.median(t.rates)
            equal = t.outputs == tallies["plain"][s].outputs
            same &= equal
            ks = " ".join(f"{k}:{n}" for k, n in sorted(t.k_chosen.items()))
            table.add_row(name, s, f"{rate:.1f}", f"{rate / base:.2f}x",
                          f"{t.accepted / t.drafted:.0%} ({t.accepted}/{t.drafted})" if t.drafted else "-",
                          f"{(t.accepted + t.steps) / t.steps:.2f}" if t.steps else "-", ks or "-", str(equal))
            rows.append({"method": name, "prompts": s, "tokens_per_second": rate, "rounds": t.rates,
                         "vs_plain": rate / base, "drafted": t.drafted, "accepted": t.accepted, "steps": t.steps,
                         "k_chosen": t.k_chosen, "output_equals_plain": equal})
    Console(width=200).print(table)
    print(f"prompt tokens: {[[len(p) for p in ps] for ps in sets.values()]}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return same


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--draft_quant", nargs="+", default=["W4A16"], choices=["W4A16", "W8A16"],
                        help="the draft engines (each its own rows, in the same rounds)")
    parser.add_argument("--draft_dtype", default=None, choices=["float32", "bfloat16"],
                        help="the draft engines' activations (default: --dtype)")
    parser.add_argument("--ngram_k", type=int, default=8, help="k (most drafts per step) of prompt lookup")
    parser.add_argument("--draft_k", type=int, default=4, help="k (most drafts per step) of the draft engine")
    parser.add_argument("--new_tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per set")
    parser.add_argument("--fixed", action="store_true", help="also the fixed-k rows (adaptive off)")
    parser.add_argument("--no_ngram", action="store_true", help="leave out the prompt lookup rows")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--workdir", default="/tmp/bestiary-speculative-bench")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    tallies, sets = measure(args)
    same = report(args, tallies, sets)
    print(f"{time.perf_counter() - start:.0f} s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
