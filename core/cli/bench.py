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
import time
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
    p.add_argument("--engine_dir", nargs="+", type=path_arg, default=[],
                   help="One or more engine dirs (a row each); required unless --shape is given.")
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
    add_shape_flags(p)


def add_shape_flags(p: argparse.ArgumentParser) -> None:
    """--shape and its flags: real-size synthetic models made once into a cache (core.bench.synthetic)."""
    from bestiary.core.bench.synthetic import DEFAULT_MODES, GGUF_TYPES, MODES, SHAPES

    g = p.add_argument_group("real sizes (random weights, made once and cached; docs/bench.md#real-sizes)")
    g.add_argument("--shape", default=None, metavar="NAME",
                   help=f"Bench a synthetic model of a published shape: {', '.join(SHAPES)}; its engines are "
                        "rows next to --engine_dir's, its GGUFs llama.cpp rows (default: no synthetic model).")
    g.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), metavar="MODE",
                   help=f"--shape: the engines made and benched, some of {', '.join(MODES)} "
                        f"(default: {' '.join(DEFAULT_MODES)}).")
    g.add_argument("--gguf_types", nargs="*", default=list(GGUF_TYPES), metavar="QTYPE",
                   help=f"--shape: the llama.cpp GGUFs made (gguf-py) and benched with --compare llama.cpp, some of "
                        f"{', '.join(GGUF_TYPES)}; the flag alone: none (default: {' '.join(GGUF_TYPES)}).")
    g.add_argument("--cache_dir", type=path_arg, default=None, metavar="DIR",
                   help="--shape: where the synthetic models are made and kept (default: the bestiary cache's "
                        "synthetic/ folder, $BESTIARY_CACHE or ~/.cache/bestiary).")


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
        k = f"k<={speculative.num_draft_tokens}" if speculative.adaptive else f"k={speculative.num_draft_tokens}"
        tag = f"{speculative.method} {k}"
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
    if args.shape is not None and args.gguf_types and "llama.cpp" not in compare:
        compare.append("llama.cpp")  # the GGUFs of --shape are llama.cpp rows
    if args.reference is not None and args.reference not in ("engine", *compare):
        raise BestiaryError(f"--reference {args.reference}: expected engine or a --compare peer "
                            f"({', '.join(compare) or 'none given'})")
    if not args.engine_dir and args.shape is None:
        raise BestiaryError("bench: give --engine_dir ENGINE ... or --shape NAME (a synthetic model)")
    if args.shape is not None and "rewrite" in config.workloads:
        raise BestiaryError(f"--workloads rewrite: the --shape {args.shape} engines have no tokenizer (random "
                            "weights, token-id prompts); leave rewrite out")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.shape is not None:
        shape_engines, shape_ggufs = synthetic_models(args)
        args.engine_dir = [*args.engine_dir, *shape_engines]
        args.gguf = [*args.gguf, *shape_ggufs]
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


def check_shape_flags(args: argparse.Namespace) -> None:
    """--shape's one-line errors before anything is made: the shape and modes known, the disk holding
    what is not made yet, gguf-py and llama-cpp-python importable when GGUFs are asked for."""
    import importlib.util

    from bestiary.core.bench.synthetic import (
        GGUF_TYPES,
        missing_bytes,
        mode_quantization,
        need_disk,
        shape_dir,
        shape_named,
    )

    shape = shape_named(args.shape)
    for mode in args.modes:
        mode_quantization(mode)
    for qtype in args.gguf_types:
        if qtype not in GGUF_TYPES:
            raise BestiaryError(f"--gguf_types {qtype}: expected some of {', '.join(GGUF_TYPES)} "
                                "(gguf-py has no K-quant quantizer)")
    cache = Path(args.cache_dir) if args.cache_dir else None
    need_disk(shape_dir(shape, cache), missing_bytes(shape, args.modes, args.gguf_types, cache),
              f"--shape {shape.name} (what is not made yet)")
    if args.gguf_types:
        for module, package in (("gguf", "gguf"), ("llama_cpp", "llama-cpp-python")):
            if importlib.util.find_spec(module) is None:
                raise BestiaryError(f"--gguf_types {' '.join(args.gguf_types)}: {package} is not installed "
                                    f"(pip install {package}); or pass --gguf_types alone for no GGUF")


def synthetic_models(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(engine dirs, GGUF files) of --shape, made or reused in --cache_dir: the source and GGUFs under
    a rich progress bar (tensors written), the engines under convert's own bars; a line each on stderr
    says what was made or reused, its size and time."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bestiary.core.bench import synthetic as syn

    check_shape_flags(args)
    shape = syn.shape_named(args.shape)
    cache = Path(args.cache_dir) if args.cache_dir else None
    err = Console(stderr=True)
    tty = sys.stderr.isatty()
    err.print(f"--shape {shape.name} ({shape.like}, {shape.params() / 1e6:,.1f}M weights) in "
              f"{syn.shape_dir(shape, cache)}", markup=False, highlight=False, soft_wrap=True)

    def made(what: str, path: Path, seconds: float, existed: bool) -> None:
        verb = "reused" if existed else "made"
        err.print(f"  {what}: {verb}, {syn.artifact_bytes(path) / 2**20:,.0f} MiB, {seconds:.1f} s  {path}",
                  markup=False, highlight=False, soft_wrap=True)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not tty) as bar:
        tasks: dict[str, object] = {}

        def progress(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(f"{shape.name} {what}", total=total)
            bar.update(tasks[what], completed=done)  # type: ignore[arg-type]

        if syn.unmade(shape, args.modes, args.gguf_types, cache):  # once all is made the source may be deleted
            start, existed = time.perf_counter(), syn.source_path(shape, cache).exists()
            source = syn.synthetic_source(shape, cache, progress)
            made("source", source, time.perf_counter() - start, existed)
        else:
            err.print("  source: not needed (every engine and GGUF asked for is made)", markup=False,
                      highlight=False)
    engines = []
    for mode in args.modes:
        start, existed = time.perf_counter(), syn.engine_path(shape, mode, cache).exists()
        engines.append(syn.synthetic_engine(shape, mode, cache, show_progress=tty))
        made(f"engine {mode}", engines[-1], time.perf_counter() - start, existed)
    ggufs = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not tty) as bar:
        tasks.clear()
        for qtype in args.gguf_types:
            start, existed = time.perf_counter(), syn.gguf_path(shape, qtype, cache).exists()
            ggufs.append(syn.synthetic_gguf(shape, [qtype], cache, progress)[qtype])
            made(f"gguf {qtype}", ggufs[-1], time.perf_counter() - start, existed)
    return [str(e) for e in engines], [str(g) for g in ggufs]
