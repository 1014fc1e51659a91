"""`bestiary bench`: batch-1 decode, prefill (TTFT) and a mixed workload on engines, beside peers;
on request (--workloads rewrite) an input-grounded rewrite task on engines.

    bestiary bench --engine_dir ENGINE [ENGINE ...] [--compare hf,llama.cpp,fastllm]
                   [--hf_model DIR_OR_GGUF] [--gguf FILE ...] [--json]

The flags of what is measured are BenchConfig's fields (core.bench.config); the peers' flags say
where their models are (core.bench.peers). A missing peer package or model is a "skipped" line.
Flags for the engine side (a later --speculative) go to `engine_candidates`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from bestiary.core.bench.config import ALL_WORKLOADS, BenchConfig
from bestiary.core.cli.main import command
from bestiary.core.cli.parsing import path_arg, positive_int, thread_count
from bestiary.core.cli.speculative_flags import add_speculative_flags, speculative_from_args
from bestiary.core.format.errors import BestiaryError

if TYPE_CHECKING:
    from rich.console import Console

    from bestiary.core.bench.peers import Candidate
    from bestiary.core.bench.run import BenchReport
    from bestiary.core.cli.main import SubParsers
    from bestiary.core.runtime.speculative_config import SpeculativeConfig


def add_bench_parser(sub: SubParsers) -> None:
    """The `bench` subcommand's flags (defaults and help from BenchConfig)."""
    f = BenchConfig.model_fields
    p = sub.add_parser("bench", help="decode / prefill / mixed-workload (and rewrite) speed of engines, beside peers "
                                       "(docs/bench.md)")
    p.add_argument("--engine_dir", nargs="+", type=path_arg, required=True,
                   help="One or more engine dirs (a row each).")
    p.add_argument("--compare", default="", metavar="PEERS",
                   help="Comma-separated peers run in the same process: hf, llama.cpp, fastllm (default: none).")
    p.add_argument("--reference", default=None, metavar="NAME",
                   help="Row the ratio columns divide by: engine, hf, llama.cpp or fastllm (its first row; "
                        "default: the first peer measured, else the first engine).")
    p.add_argument("--json", action="store_true", help="Print the report as JSON on stdout instead of tables.")
    p.add_argument("--num_threads", type=thread_count, default=None,
                   help="CPU threads of every system (default: torch's own count, one per physical core).")
    g = p.add_argument_group("workloads")
    g.add_argument("--workloads", nargs="+", choices=ALL_WORKLOADS, default=f["workloads"].default,
                   help=f["workloads"].description)
    for name in ("new_tokens", "repeats", "rounds", "decode_prompt_len", "mixed_requests", "rewrite_texts",
                 "rewrite_text_tokens", "static_batch", "seed", "bandwidth_mib"):
        kind = int if name in ("seed", "bandwidth_mib") else positive_int
        g.add_argument(f"--{name}", type=kind, default=f[name].default,
                       help=f"{f[name].description} (default: {f[name].default})")
    g.add_argument("--prompt_lens", nargs="+", type=positive_int, default=f["prompt_lens"].default,
                   help=f"{f['prompt_lens'].description} (default: {f['prompt_lens'].default})")
    for name in ("mixed_prompt_lens", "mixed_output_lens"):
        g.add_argument(f"--{name}", nargs=2, type=positive_int, default=f[name].default, metavar=("LOW", "HIGH"),
                       help=f"{f[name].description} (default: {f[name].default})")
    g = p.add_argument_group("peers")
    g.add_argument("--hf_model", type=path_arg, default=None,
                   help="hf and fastllm: an HF dir, or a .gguf made dense once (cached).")
    g.add_argument("--hf_dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16", "float16"], help="hf: the dtypes HF transformers runs in, a row each.")
    g.add_argument("--gguf", nargs="+", type=path_arg, default=[], metavar="FILE",
                   help="llama.cpp: GGUF files, a row each (default: none).")
    add_speculative_flags(p)  # a second row per engine, decoding speculatively (docs/speculative.md)
    g.add_argument("--fastllm_dtypes", nargs="+", default=["float16", "int8", "int4"],
                   choices=["float32", "float16", "int8", "int4"], help="fastllm: the dtypes of its weights, a row each.")


def bench_config(args: argparse.Namespace) -> BenchConfig:
    from bestiary.core.format.config import validate_config

    fields = {name: getattr(args, name) for name in BenchConfig.model_fields}
    return validate_config(BenchConfig, fields, "bench flags")


def compare_names(text: str) -> list[str]:
    from bestiary.core.bench.peers import PEER_NAMES

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise BestiaryError(f"--compare {text}: {unknown[0]!r} is not a peer; expected some of {', '.join(PEER_NAMES)}")
    return list(dict.fromkeys(names))


def engine_candidates(dirs: list[str], threads: int | None,
                      speculative: SpeculativeConfig | None = None) -> list[Candidate]:
    """A row per engine dir; with `speculative` (a SpeculativeConfig) a second row per engine decoding with it."""
    from bestiary.core.bench.peers import Candidate
    from bestiary.core.bench.systems import EngineSystem

    rows = [Candidate("engine", f"bestiary {Path(d).name}", functools.partial(EngineSystem, d, threads)) for d in dirs]
    if speculative is not None:
        tag = f"{speculative.method} k={speculative.num_draft_tokens}"
        rows += [Candidate("engine", f"bestiary {Path(d).name} + {tag}",
                           functools.partial(EngineSystem, d, threads, speculative), plain=plain)
                 for d, plain in zip(dirs, rows, strict=True)]
    return rows


def engine_vocab(engine_dir: str) -> int:
    """The vocabulary size of an engine (or checkpoint) dir, from its config.json."""
    from bestiary.core.format.config import config_sections, read_json

    data = read_json(Path(engine_dir) / "config.json")
    vocab = config_sections(data, f"{engine_dir}/config.json")[0].get("vocab_size")
    if not isinstance(vocab, int):
        raise BestiaryError(f"{engine_dir}/config.json: no integer vocab_size")
    return vocab


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 goes to stderr meanwhile: what peers' C libraries print (ftllm prints its
    loading to stdout) cannot mix into the tables or the JSON on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@command("bench", add_bench_parser)
def cmd_bench(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from bestiary.core.bench.peers import PeerOptions, candidates
    from bestiary.core.bench.run import run_bench
    from bestiary.core.cli.bench_tables import print_report

    config = bench_config(args)
    compare = compare_names(args.compare)
    if args.reference is not None and args.reference not in ("engine", *compare):
        raise BestiaryError(f"--reference {args.reference}: expected engine or a --compare peer "
                            f"({', '.join(compare) or 'none given'})")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    for d in args.engine_dir:
        if not (Path(d) / "config.json").is_file():
            raise BestiaryError(f"--engine_dir {d}: no config.json (not an engine dir)")
    if "rewrite" in config.workloads:
        from bestiary.core.bench.rewrite import rewrite_problem

        for d in args.engine_dir:
            if (problem := rewrite_problem(d)) is not None:
                raise BestiaryError(f"--workloads rewrite: engine {d} {problem}")
    vocab = engine_vocab(args.engine_dir[0])
    longest = max(max(config.prompt_lens), config.mixed_prompt_lens[1] + config.mixed_output_lens[1],
                  config.decode_prompt_len + config.new_tokens + 1)
    opts = PeerOptions(hf_model=Path(args.hf_model) if args.hf_model else None, hf_dtypes=args.hf_dtypes,
                       gguf=[Path(g) for g in args.gguf], fastllm_dtypes=args.fastllm_dtypes,
                       num_threads=torch.get_num_threads(), static_batch=config.static_batch, n_ctx=longest + 8)
    engines = engine_candidates(args.engine_dir, args.num_threads, speculative_from_args(args))
    systems = engines + candidates(compare, opts)
    err = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True, disable=not sys.stderr.isatty()) as progress, stdout_to_stderr():
        task = progress.add_task("bench", total=None)
        report = run_bench(config, systems, vocab, on_step=lambda what: progress.update(task, description=what))
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print_report(report, args.reference)
    print_differing(report, err)
    return 1 if report.differing else 0


def print_differing(report: BenchReport, err: Console) -> None:
    """A red line per speculative row whose rewrite output is not its plain row's: greedy speculative
    decoding must reproduce plain decoding, so each is a failed check."""
    for r in report.differing:
        assert r.rewrite is not None  # BenchReport.differing: rows with a rewrite result that differs
        err.print(f"{r.label}: rewrite output differs from {r.rewrite.plain_label} at {r.rewrite.differs}",
                  style="red", markup=False, highlight=False, soft_wrap=True)
