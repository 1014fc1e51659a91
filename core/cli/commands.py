"""Handlers of the `bestiary` subcommands (registered into cli.COMMANDS on import)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bestiary.core.cli.main import command
from bestiary.core.format.errors import BestiaryError
from rich.console import Console
from rich.table import Table

ERR = Console(stderr=True)


def stdout_console() -> Console:
    """Console for tables on stdout; wide when piped, so names are never cut."""
    return Console() if sys.stdout.isatty() else Console(width=240)


def _threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


@command("convert")
def cmd_convert(args: argparse.Namespace) -> int:
    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.quant.options import QuantFlags, quant_config_from_flags

    flags = QuantFlags(**{f: getattr(args, f) for f in QuantFlags.__dataclass_fields__})
    out = convert(args.model_dir, args.output_dir, dtype=args.dtype, tp_size=args.tp_size, pp_size=args.pp_size,
                  architecture=args.architecture, show_progress=sys.stderr.isatty(),
                  quantization=quant_config_from_flags(flags) if flags.any() else None,
                  calib_text=args.calib_text, smoothquant_alpha=args.smoothquant,
                  weight_quantizer=args.weight_quantizer, tune_steps=args.tune_steps)
    ERR.print(f"checkpoint written to {out}")
    return 0


@command("build")
def cmd_build(args: argparse.Namespace) -> int:
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.format.config import validate_config

    flags = {k: getattr(args, k) for k in BuildConfig.model_fields if getattr(args, k) is not None}
    build = validate_config(BuildConfig, flags, "build flags")
    out = build_engine(args.checkpoint_dir, args.output_dir, build)
    ERR.print(f"engine written to {out}")
    return 0


def _sampling(args: argparse.Namespace):
    from bestiary.core.format.config import validate_config
    from bestiary.core.runtime.sampling import SamplingConfig

    same = ("temperature", "top_k", "top_p", "random_seed", "length_penalty", "beam_search_diversity_rate",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "min_length", "top_p_decay", "top_p_min",
            "top_p_reset_ids", "end_id", "ignore_eos", "output_log_probs")
    fields = {name: getattr(args, name) for name in same}
    fields.update(max_new_tokens=args.max_output_len, beam_width=args.num_beams)
    if args.early_stopping is not None:
        fields["early_stopping"] = {"true": True, "false": False}.get(args.early_stopping, args.early_stopping)
    for name in ("stop_words", "bad_words"):
        if getattr(args, name):
            fields[name] = [_word(w) for w in getattr(args, name)]
    fields = {k: v for k, v in fields.items() if v is not None}
    return validate_config(SamplingConfig, fields, "sampling flags")


def _word(text: str) -> str | list[int]:
    """A --stop_words/--bad_words value: comma-separated integers are ids, anything else text."""
    parts = text.split(",")
    return [int(p) for p in parts] if all(p.strip().isdigit() for p in parts) else text


def _parse_ids(groups: list[str]) -> list[list[int]]:
    try:
        return [[int(t) for t in g.replace(",", " ").split()] for g in groups]
    except ValueError:
        raise BestiaryError(f"--input_ids {' '.join(groups)!r}: expected comma-separated integers") from None


@command("run")
def cmd_run(args: argparse.Namespace) -> int:
    from bestiary.core.runtime.llm import LLM

    sampling = _sampling(args)
    llm = LLM(args.engine_dir, num_threads=args.num_threads)
    prompts: list = _parse_ids(args.input_ids) if args.input_ids else list(args.input_text)
    if llm.tokenizer is None and not args.input_ids:
        raise BestiaryError(f"{args.engine_dir}: engine has no tokenizer; use --input_ids")
    as_ids = args.output_ids or llm.tokenizer is None
    if args.streaming:
        for prompt in prompts:
            for piece in llm.generate_stream(prompt, sampling, chat=args.chat):
                sys.stdout.write(f"{piece} " if as_ids and isinstance(piece, int) else str(piece))
                sys.stdout.flush()
            sys.stdout.write("\n")
            _print_stats(llm.last_stats)
        return 0
    completions = llm.generate(prompts, sampling, chat=args.chat)
    for c in completions:
        print(" ".join(map(str, c.output_ids)) if as_ids else c.text)
        if args.output_log_probs:
            print(json.dumps(_log_prob_record(c)))
    _print_stats(llm.last_stats)
    return 0


def _log_prob_record(c) -> dict:
    """--output_log_probs: the output's log probs, and every beam's ids and score for beam search."""
    record = {"cum_log_prob": c.cum_log_prob, "log_probs": c.log_probs, "finish_reason": c.finish_reason}
    if c.beams:
        record["beams"] = [{"output_ids": b.output_ids, "score": b.score, "cum_log_prob": b.cum_log_prob}
                           for b in c.beams]
    return record


def _print_stats(stats) -> None:
    ttft = f"{stats.first_token_seconds * 1000:.0f} ms" if stats.first_token_seconds is not None else "-"
    print(
        f"[bestiary] {stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated in {stats.seconds:.2f} s: "
        f"{stats.tokens_per_second:.1f} tokens/s ({stats.decode_tokens_per_second:.1f} decode), first token {ttft}",
        file=sys.stderr,
    )


@command("eval")
def cmd_eval(args: argparse.Namespace) -> int:
    from bestiary.core.runtime.engine import Engine
    from bestiary.core.runtime.evaluate import perplexity

    _threads(args.num_threads)
    path = Path(args.text_file)
    if not path.is_file():
        raise BestiaryError(f"{path}: no such text file")
    engine = Engine.load(args.engine_dir)
    if engine.tokenizer is None:
        raise BestiaryError(f"{args.engine_dir}: engine has no tokenizer; eval needs one")
    ids = engine.tokenizer.encode(path.read_text())
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    result = perplexity(engine, ids)
    print(json.dumps({"tokens": result.tokens, "nll": round(result.nll, 6), "perplexity": round(result.perplexity, 4)}))
    return 0


@command("inspect")
def cmd_inspect(args: argparse.Namespace) -> int:
    from bestiary.core.format.config import read_json
    from safetensors import safe_open

    directory = Path(args.directory)
    data = read_json(directory / "config.json")
    out = stdout_console()
    config = data.get("pretrained_config", data)
    table = Table(title=f"{directory} ({'engine' if 'pretrained_config' in data else 'checkpoint'})")
    table.add_column("field")
    table.add_column("value")
    for key, value in config.items():
        table.add_row(key, json.dumps(value))
    for key, value in data.get("build_config", {}).items():
        table.add_row(f"build.{key}", json.dumps(value))
    out.print(table)
    for rank_path in sorted(directory.glob("rank*.safetensors")):
        tensors = Table(title=rank_path.name)
        for col in ("tensor", "shape", "dtype", "MiB"):
            tensors.add_column(col, justify="right" if col == "MiB" else "left")
        total = 0
        try:
            with safe_open(str(rank_path), framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    shape = part.get_shape()
                    numel = 1
                    for d in shape:
                        numel *= d
                    size = numel * _dtype_bytes(part.get_dtype())
                    total += size
                    tensors.add_row(key, str(tuple(shape)), part.get_dtype(), f"{size / 2**20:.2f}")
        except Exception as err:  # noqa: BLE001
            raise BestiaryError(f"{rank_path}: not a readable .safetensors file ({err})") from None
        tensors.add_section()
        tensors.add_row("total", "", "", f"{total / 2**20:.2f}")
        out.print(tensors)
    return 0


def _dtype_bytes(name: str) -> int:
    return {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "F8_E4M3": 1, "BOOL": 1}.get(name, 4)


@command("list")
def cmd_list(args: argparse.Namespace) -> int:
    from bestiary.registry import default_registry

    registry = default_registry()
    table = Table(title="bestiary architectures")
    for col in ("architecture", "package", "HF architectures", "model types", "supports"):
        table.add_column(col, no_wrap=True)
    table.add_column("description")
    for name in registry.names():
        spec = registry.specs[name]
        table.add_row(name, spec.package, ", ".join(spec.hf_architectures), ", ".join(spec.hf_model_types),
                      spec.supports.summary(), spec.description)
    stdout_console().print(table)
    for failure in registry.failures:
        ERR.print(f"[red]plugin {failure.name!r} (package {failure.package}) failed to load:[/red]")
        ERR.print(failure.traceback, markup=False, highlight=False)
    return 0


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from bestiary.core.cli.demo import run_demo

    _threads(args.num_threads)
    return run_demo(args.prompt, args.max_output_len, args.dtype, args.workdir)
