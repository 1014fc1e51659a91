"""The `bestiary` command line: convert, build, export, run, eval, inspect, list, cache, serve, chat, demo,
bench. Each command's module registers its handler and the function adding its parser (@command);
make_parser walks COMMAND_MODULES.

User mistakes (BestiaryError) print one line `error: ...` on stderr and exit with code 2,
environment faults (read-only or full disk, memory) with code 1 (core.cli.failures has the
table); a bad flag is the parser's one-line error (core.cli.parsing), also exit code 2. Heavy modules
load inside commands.
"""

from __future__ import annotations

import argparse
import importlib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bestiary.core.cli.parsing import (
    INT32_MAX,
    OneLineParser,
    int_range,
    non_negative_int,
    path_arg,
    positive_int,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    SubParsers: TypeAlias = argparse._SubParsersAction[OneLineParser]  # what add_subparsers returns

Handler = Callable[[argparse.Namespace], int]
AddParser = Callable[["SubParsers"], None]

# Every `bestiary COMMAND`, in `bestiary --help` order, and the module of core.cli that registers its
# handler and its parser with @command (the module is imported when the parser is made).
COMMAND_MODULES: dict[str, str] = {
    "convert": "commands", "build": "commands", "export": "commands", "run": "commands", "eval": "commands",
    "inspect": "commands", "list": "commands", "cache": "commands", "serve": "serve", "chat": "chat",
    "demo": "commands", "lm-eval": "lm_eval_command", "bench": "bench",
}


@dataclass(frozen=True)
class Command:
    """One `bestiary COMMAND`: its handler and the function adding its parser to the subparsers."""

    run: Handler
    add_parser: AddParser


COMMANDS: dict[str, Command] = {}


def command(name: str, add_parser: AddParser) -> Callable[[Handler], Handler]:
    """Register a `bestiary NAME` handler with `add_parser(sub)`, which adds NAME's subparser (its
    flags, defaults and help) to `sub`; `name` must be a key of COMMAND_MODULES."""

    def wrap(fn: Handler) -> Handler:
        COMMANDS[name] = Command(fn, add_parser)
        return fn

    return wrap


def _bound(field, name: str, default: int) -> int:
    """The field's `ge` / `le` bound (pydantic keeps them in its metadata), else `default`."""
    return next((getattr(m, name) for m in field.metadata if getattr(m, name, None) is not None), default)


def add_model_flags(parser: argparse.ArgumentParser, model) -> None:
    """One --flag per field of a pydantic model (the schema is the single source of the options); an
    int field is an int_range flag of the field's bounds (ge, default 1; le, default INT32_MAX), so a
    value out of range is the parser's one-line error naming the flag."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        kind = args[0] if args[0] in (int, float, str) else str
        if kind is int:
            kind = int_range(_bound(field, "ge", 1), _bound(field, "le", INT32_MAX))
        text = (field.description or "").replace("%", "%%")  # a default of None: the description says what then
        shown = field.default is not None and "default" not in text.lower()
        parser.add_argument(f"--{name}", type=kind, default=None,
                            help=f"{text} (default: {field.default})" if shown else text)


THREADS_HELP = ("torch CPU threads, 1 to 1024 (default: BESTIARY_NUM_THREADS, else the CPUs this process may use, "
                "fewer while other processes keep them busy; docs/runtime.md).")
ENGINE_HELP = ("Engine or checkpoint directory (any other source, e.g. an HF dir or a .gguf, is converted and "
               "built into the cache on first use).")
SEED_HELP = "Seed of each request's generator; the same seed repeats a sampled run (default: unseeded)."


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max_output_len", type=positive_int, default=64, help="New tokens per input.")
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 = greedy.")
    parser.add_argument("--top_k", type=int, default=0, help="Keep the k most likely tokens; 0 = off.")
    parser.add_argument("--top_p", type=float, default=1.0, help="Keep the tokens whose probability sums to p; 1.0 = off.")
    parser.add_argument("--random_seed", type=int, default=None, help=SEED_HELP)
    g = parser.add_argument_group("penalties, stopping and beam search (docs/sampling.md)")
    g.add_argument("--num_beams", type=positive_int, default=None, help="Beam search width (default: 1, off).")
    g.add_argument("--length_penalty", type=float, default=None,
                   help="Beam score = cum log prob / len ** this (default: 1.0).")
    g.add_argument("--early_stopping", choices=["true", "false", "never"], default=None,
                   help="Beam search end rule (false = HF's heuristic, the default).")
    g.add_argument("--beam_search_diversity_rate", type=float, default=None,
                   help="Rank penalty within a beam (default: 0.0).")
    g.add_argument("--repetition_penalty", type=float, default=None,
                   help="Over prompt + output; 1.0 = off (default: 1.0).")
    g.add_argument("--presence_penalty", type=float, default=None, help="Over the output; 0 = off (default: 0.0).")
    g.add_argument("--frequency_penalty", type=float, default=None,
                   help="Per occurrence in the output; 0 = off (default: 0.0).")
    g.add_argument("--min_length", type=int, default=None,
                   help="Generated tokens before an end id may be chosen (default: 0).")
    g.add_argument("--top_p_decay", type=float, default=None,
                   help="top_p *= this after each token; 1.0 = off (default: 1.0).")
    g.add_argument("--top_p_min", type=float, default=None, help="Lower bound of the decayed top_p (default: 1e-06).")
    g.add_argument("--top_p_reset_ids", type=int, default=None, help="This id resets the decayed top_p (default: none).")
    g.add_argument("--stop_words", nargs="+", default=None, metavar="WORD",
                   help="Text (or comma-separated ids like 13,198) that ends generation (default: none).")
    g.add_argument("--bad_words", nargs="+", default=None, metavar="WORD",
                   help="Text (or comma-separated ids) never generated (default: none).")
    g.add_argument("--end_id", type=int, default=None, help="Stop token (default: the tokenizer's).")
    g.add_argument("--ignore_eos", action="store_true", help="Generate until --max_output_len.")
    g.add_argument("--output_log_probs", action="store_true",
                   help="After each output, print a JSON line with log probs (and beams).")
    w = parser.add_argument_group("attention window (docs/attention-window.md)")
    w.add_argument("--max_attention_window", type=positive_int, default=None,
                   help="Attend to at most this many recent keys, sinks included "
                        "(default: the engine's; at most that).")
    w.add_argument("--sink_token_length", type=non_negative_int, default=None,
                   help="First tokens every windowed query keeps attending to (default: the engine's; 0 = none).")


def add_quant_flags(parser: argparse.ArgumentParser) -> None:
    """convert's quantization flags (docs/quantization.md; checked in core.quant.options)."""
    q = parser.add_argument_group("quantization")
    q.add_argument("--use_weight_only", action="store_true", help="Weight-only quantization of the linears.")
    q.add_argument("--weight_only_precision", default=None, choices=["int8", "int4"],
                   help="int8 per output channel (W8A16, default) or int4 group-wise (W4A16).")
    q.add_argument("--activation_precision", default=None, choices=["int8"],
                   help="With --use_weight_only: int8 activations quantized per token and 64 features at run time "
                        "(int8 weights: W8A8 dynamic, int4: W4A8; int32 dot products; default: 16-bit activations).")
    q.add_argument("--group_size", type=positive_int, default=None,
                   help="int4 group size (weight-only int4, --w4a8_awq): 32, 64 or 128 (default 128).")
    q.add_argument("--has_zero_point", action="store_true", help="int4 with per-group zero points.")
    q.add_argument("--exclude_modules", nargs="+", default=None, metavar="NAME",
                   help="Module names or globs left unquantized, e.g. lm_head mlp.proj (default: none).")
    q.add_argument("--int8_kv_cache", action="store_true", help="INT8 KV cache with per-layer scales.")
    q.add_argument("--fp8_kv_cache", action="store_true", help="FP8 (e4m3) KV cache with per-layer scales.")
    q.add_argument("--fp8", action="store_true",
                   help="FP8: e4m3 weights and activations, per-tensor scales (calibrated).")
    q.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA",
                   help="W8A8_SQ_PER_CHANNEL: SmoothQuant with migration strength 0 < ALPHA <= 1 (e.g. 0.5), "
                        "int8 weights and activations (default: off).")
    q.add_argument("--w4a8_awq", action="store_true",
                   help="W4A8_AWQ: int4 group-wise weights with AWQ scales, FP8 activations.")
    q.add_argument("--weight_quantizer", default=None, choices=["rtn", "gptq"],
                   help="How weights are rounded: rtn (round to nearest) or gptq (calibrated error "
                        "compensation, int4 only). Default: gptq for weight-only int4, else rtn.")
    q.add_argument("--tune_steps", type=int, default=None, metavar="N",
                   help="int4 GPTQ: steps of end-to-end scale tuning towards the float model's outputs "
                        "on the calibration text (0 = none; default: a short tuning).")
    q.add_argument("--calib_text", type=path_arg, default=None, metavar="FILE",
                   help="Text file for calibration (KV cache and activation scales); default: a short built-in text.")


def load_command(name: str) -> Command:
    """The registered Command `name`, importing the module of core.cli that registers it."""
    importlib.import_module(f"bestiary.core.cli.{COMMAND_MODULES[name]}")
    return COMMANDS[name]


def make_parser() -> argparse.ArgumentParser:
    """The `bestiary` parser: --version, and each command's subparser, added by the command itself."""
    from bestiary import __version__

    parser = OneLineParser(prog="bestiary", description="Plugin-based LLM model zoo and inference engine.")
    parser.add_argument("--version", action="version", version=f"bestiary {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        load_command(name).add_parser(sub)
    return parser


OWN_CTRL_C = ("chat", "serve")  # Ctrl-C stops chat's answer / drains serve: a caught one is not held against them
TORCH_FREE = ("list", "cache")  # every other command imports torch (whole, first: interrupts.deferred)


def main(argv: list[str] | None = None) -> int:
    """Run one `bestiary` command: every failure is one line and an exit code (cli.failures).

    SIGINT / SIGTERM raise `Interrupted` from the parser on, and are remembered (core.format.interrupts):
    one that a library swallowed still refuses every commit and ends the command with 130 / 143. torch
    is imported first, whole, with signals deferred to its end (its C++ import code swallows or aborts on
    a KeyboardInterrupt). chat and serve handle Ctrl-C themselves (OWN_CTRL_C)."""
    from bestiary.core.cli.failures import check_text_args, exit_code_for
    from bestiary.core.format import interrupts

    with interrupts.handled():
        try:
            args = make_parser().parse_args(argv)  # imports every command's module: COMMANDS has them all
            interrupts.check()
            if args.command not in TORCH_FREE:
                with interrupts.deferred():  # a Ctrl-C inside torch's import is swallowed or aborts: raised after it
                    import torch  # noqa: F401
                from bestiary.core.runtime.threads import start_command

                start_command(getattr(args, "num_threads", None))  # the CPUs it may use (core.runtime.threads)
            check_text_args(args)
            if args.command in OWN_CTRL_C:
                with interrupts.not_remembered():
                    return COMMANDS[args.command].run(args) or 0
            code = COMMANDS[args.command].run(args) or 0
            interrupts.check()
            return code
        except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - the one error path
            return exit_code_for(err)
