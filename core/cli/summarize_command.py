"""`bestiary eval --task summarize`'s flags and run (core.bench.summarize); `bestiary eval`'s parser
(core.cli.commands) adds the flags and hands a summarize task here."""

from __future__ import annotations

import argparse
import importlib.util
import json

from bestiary.core.cli.parsing import path_arg, positive_int
from bestiary.core.format.errors import BestiaryError


def add_summarize_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--task summarize (docs/evaluation.md)")
    g.add_argument("--dataset", type=path_arg, default=None, metavar="FILE.jsonl",
                   help="Articles: one JSON object a line with text fields 'article' and 'highlights' (required by "
                        "--task summarize).")
    g.add_argument("--hf_model_dir", type=path_arg, default=None,
                   help="The HF model the engine is compared with (required by --task summarize).")
    g.add_argument("--max_output_len", type=positive_int, default=100, help="New tokens per summary.")
    g.add_argument("--max_input_len", type=positive_int, default=923, help="Article tokens kept.")
    g.add_argument("--max_articles", type=positive_int, default=None,
                   help="Summarize the first N articles only (default: all).")
    g.add_argument("--check_accuracy", action="store_true",
                   help="Exit 1 when the engine's ROUGE-1 is more than --rouge1_threshold below HF's.")
    g.add_argument("--rouge1_threshold", type=float, default=1.0, help="Allowed ROUGE-1 drop, in points.")
    g.add_argument("--lora_dir", type=path_arg, default=None, metavar="DIR",
                   help="An HF PEFT adapter both models run with: the engine per request, HF through peft "
                        "(default: none, the base models).")


def run_summarize(args: argparse.Namespace) -> int:
    """Print the report as one JSON line; 1 when --check_accuracy fails, else 0."""
    from bestiary.core.bench.summarize import summarize
    from bestiary.core.runtime.llm import LLM

    for flag in ("dataset", "hf_model_dir"):
        if getattr(args, flag) is None:
            raise BestiaryError(f"--task summarize needs --{flag}")
    needed = [("rouge_score", "rouge-score"), ("transformers", "transformers")] + [("peft", "peft")] * bool(args.lora_dir)
    for module, package in needed:
        if importlib.util.find_spec(module) is None:  # before the engine loads: one line, no traceback
            raise BestiaryError(f"--task summarize needs {package}: pip install 'bestiary[eval]'")
    llm = LLM(args.engine_dir, num_threads=args.num_threads, device=args.device, allow_nonfinite=args.allow_nonfinite)
    report = summarize(llm, args.dataset, args.hf_model_dir, args.max_output_len, args.max_input_len,
                       args.max_articles, args.rouge1_threshold if args.check_accuracy else None, args.lora_dir)
    print(json.dumps({"articles": report.articles, "engine": {k: round(v, 4) for k, v in report.engine.items()},
                      "hf": {k: round(v, 4) for k, v in report.hf.items()}, "identical_to_hf": report.identical,
                      "rouge1_vs_hf": round(report.rouge1_vs_hf, 4), "check_accuracy": report.passed}))
    return 1 if report.passed is False else 0
