"""Speculative decoding speed on an input-grounded task: SmolLM2-135M-Instruct rewriting a given
~300-token text, batch 1, greedy, bf16 target; plain vs prompt lookup (ngram) vs a W4A16 draft engine.

Every method runs the same prompts in one process, interleaved (repeat r runs plain, ngram, draft,
then r + 1 ...); the median of the repeats is reported. Decode tok/s = (generated - 1) / (time
after the first token), as GenerationStats.decode_tokens_per_second; the outputs of the three
methods are compared (greedy speculative decoding must reproduce plain decoding token for token).
`bestiary bench --workloads rewrite --speculative ngram|draft` measures the same prompts in the
bench (docs/speculative.md).

    python benchmarks/speculative.py [--num_draft_tokens 8] [--draft_tokens_for_draft 4]
                                     [--new_tokens 256] [--repeats 3] [--texts 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# the prompts of `bestiary bench --workloads rewrite`: INSTRUCTION + a passage, as a user turn
from bestiary.core.bench.rewrite import rewrite_messages, source_texts


def engines(workdir: Path) -> tuple[Path, Path]:
    """The bf16 target engine and the W4A16 (group 64) draft engine, built once under workdir."""
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.config import QuantConfig

    gguf, out = demo_model_path(), []
    for name, quant in (("bf16", None), ("w4a16", QuantConfig(quant_algo="W4A16", group_size=64))):
        ckpt, engine = workdir / f"{name}-ckpt", workdir / f"{name}-engine"
        if not (engine / "config.json").is_file():
            convert(gguf, ckpt,
                    ConvertOptions(dtype="bfloat16", quantization=quant, weight_quantizer="rtn" if quant else None),
                    show_progress=False)  # RTN: a draft needs speed, not the last bit
            build_engine(ckpt, engine, BuildConfig(max_batch_size=4, max_input_len=1024, max_seq_len=2048))
        out.append(engine)
    return out[0], out[1]


def main() -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.core.runtime.speculative import AcceptanceStats, SpeculativeConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_draft_tokens", type=int, default=8, help="k of prompt lookup")
    parser.add_argument("--draft_tokens_for_draft", type=int, default=4, help="k of the draft engine")
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--texts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--workdir", default="/tmp/bestiary-speculative-bench")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft = engines(Path(args.workdir))
    methods = {
        "plain": None,
        f"ngram k={args.num_draft_tokens}": SpeculativeConfig(method="ngram", num_draft_tokens=args.num_draft_tokens),
        f"draft W4A16 k={args.draft_tokens_for_draft}": SpeculativeConfig(
            method="draft", num_draft_tokens=args.draft_tokens_for_draft, draft_engine_dir=str(draft)),
    }
    llms = {name: LLM(target, speculative=spec) for name, spec in methods.items()}
    tok = llms["plain"].tokenizer
    prompts = [llms["plain"].chat_ids(rewrite_messages(t)) for t in source_texts(tok, args.texts)]
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0.0)
    for llm in llms.values():  # warm up (plans, draft caches)
        llm.generate([prompts[0]], SamplingConfig(max_new_tokens=8, temperature=0.0))
    rates = {name: [] for name in methods}
    outputs: dict[str, list[list[int]]] = {}
    stats = {name: AcceptanceStats() for name in methods}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            per_prompt, outs = [], []
            for ids in prompts:
                done = llm.generate([ids], sampling)[0]
                per_prompt.append(llm.last_stats.decode_tokens_per_second)
                outs.append(done.output_ids)
                if done.speculative is not None:
                    stats[name].add(done.speculative)
            rates[name].append(statistics.mean(per_prompt))
            outputs[name] = outs
    console = Console()
    table = Table(title=f"batch-1 decode, rewrite of {len(prompts)} texts of ~300 tokens "
                        f"(prompts {[len(p) for p in prompts]} tokens), bf16 SmolLM2-135M-Instruct")
    for col in ("method", "decode tok/s (median)", "x plain", "acceptance", "tokens / verify step", "output = plain"):
        table.add_column(col, justify="right" if col != "method" else "left")
    base = statistics.median(rates["plain"])
    for name in methods:
        rate, s = statistics.median(rates[name]), stats[name]
        table.add_row(name, f"{rate:.1f}", f"{rate / base:.2f}x",
                      f"{s.acceptance_rate:.0%} ({s.accepted}/{s.drafted})" if s.drafted else "-",
                      f"{s.tokens_per_step:.2f}" if s.steps else "-", str(outputs[name] == outputs["plain"]))
    console.print(table)
    console.print(f"generated tokens per prompt: {[len(o) for o in outputs['plain']]}")
    return 0 if all(outputs[n] == outputs["plain"] for n in methods) else 1


if __name__ == "__main__":
    sys.exit(main())
