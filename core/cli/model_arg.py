"""The model of `bestiary run|chat|serve|eval`: a positional MODEL (or the older --engine_dir) and --dtype.

MODEL is an engine dir, a checkpoint dir, or any source convert takes (an HF dir, a .gguf, .flm,
.safetensors, .bin or .pth file). A source is converted and built into the cache once
(core.runtime.llm.ensure_engine, keyed on its files' contents, core.format.cache); later starts
load the cached engine without converting. On a terminal the first start says so on stderr, with
convert's progress bars between its two lines (a pipe or a log gets no status lines: an error after
one would not be its one line):

    [bestiary] converting model.gguf into the cache (once)...
    [bestiary] engine: ~/.cache/bestiary/engines/0123456789abcdef

--engine_dir is MODEL's flag form, with the same meaning. Giving both, or neither, is a one-line
error naming both (exit 2); so is a MODEL that does not exist, a file of a type no source reader
takes, a directory that is neither bestiary's (config.json with its fields) nor an HF model
directory (config.json and weights), and --dtype other than auto with an engine or checkpoint dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bestiary.core.cli.parsing import path_arg
from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.output_dir import config_kind

DTYPES = ["auto", "float32", "float16", "bfloat16"]
MODEL_HELP = ("The model: an engine or checkpoint dir, or a source (HF dir, .gguf, .flm, .safetensors, .bin, .pth) "
              "converted and built into the cache once ($BESTIARY_CACHE); give it before the flags.")
ENGINE_DIR_HELP = "MODEL as a flag (the same meaning; give one of the two)."
DTYPE_HELP = ("dtype a source is converted to (default: %(default)s, the source config's torch_dtype, else float32); "
              "an engine or checkpoint dir keeps its own.")
ERASE_LINE = "\x1b[1A\x1b[2K"  # cursor up one line, clear it
EXPECTED = "expected an engine or checkpoint dir, an HF model dir, or a .gguf/.flm/.safetensors/.bin/.pth file"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """MODEL (positional, optional to argparse: --engine_dir may give it instead), --engine_dir and --dtype."""
    parser.add_argument("model", nargs="?", type=path_arg, default=None, metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--engine_dir", type=path_arg, default=None, help=ENGINE_DIR_HELP)
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)


def model_label(args: argparse.Namespace) -> str:
    """How the model was given, for messages: `MODEL path` or `--engine_dir path`."""
    return f"MODEL {args.model}" if args.model is not None else f"--engine_dir {args.engine_dir}"


def given_model(args: argparse.Namespace) -> Path:
    """The one path of MODEL / --engine_dir, checked: it exists and is a kind bestiary reads
    (`source_problem`); otherwise a one-line error naming MODEL (or --engine_dir)."""
    if args.model is not None and args.engine_dir is not None:
        raise BestiaryError(f"MODEL {args.model} and --engine_dir {args.engine_dir}: give one of them "
                            "(--engine_dir is MODEL as a flag)")
    if args.model is None and args.engine_dir is None:
        raise BestiaryError("MODEL or --engine_dir: required (e.g. bestiary run model.gguf --input_text ...; "
                            "MODEL goes before the flags)")
    path = Path(args.model if args.model is not None else args.engine_dir)
    problem = source_problem(path)
    if problem:
        raise BestiaryError(f"{model_label(args)}: {problem}")
    if args.dtype != "auto" and config_kind(path / "config.json") is not None:
        raise BestiaryError(f"--dtype {args.dtype}: {model_label(args)} is already a {config_kind(path / 'config.json')} "
                            "dir, in its own dtype; --dtype applies to a source converted into the cache")
    return path


def model_name(path: Path) -> str:
    """A model's name: its directory's (resolved: `.` is named), or its file's without the suffix."""
    return path.resolve().name if path.is_dir() else path.stem


def source_problem(path: Path) -> str | None:
    """Why `path` is no model at all (missing, a file of another type, a directory that is neither
    bestiary's nor an HF model's), found before any file is hashed; None when it may be one."""
    from bestiary.core.sources import WEIGHT_SUFFIXES  # imports torch: not while parsing the command line

    if not path.exists():
        return "no such file or directory"
    if path.is_file():
        return None if path.suffix in (".gguf", ".flm", *WEIGHT_SUFFIXES) else f"unsupported file type {path.suffix!r}; {EXPECTED}"
    if not path.is_dir():
        return f"not a file or directory; {EXPECTED}"
    if config_kind(path / "config.json") is not None:
        return None
    if not (path / "config.json").is_file():
        return f"a directory without config.json; {EXPECTED}"
    if not any(next(path.glob(f"*{suffix}"), None) for suffix in WEIGHT_SUFFIXES):
        return (f"config.json is not bestiary's (an engine or checkpoint dir) and there are no weights "
                f"(*.safetensors, *.bin, *.pth) of an HF model dir; {EXPECTED}")
    return None


def resolve_model(args: argparse.Namespace) -> Path:
    """The engine (or checkpoint) dir of MODEL / --engine_dir: as given, or converted and built into the
    cache the first time. On a terminal the conversion is announced before it starts, with progress bars,
    and the announcement is erased when it fails (the error stays its one line, as convert's bars are), and a
    later start names the cached engine; elsewhere (a pipe, a log) nothing is said."""
    from bestiary.core.runtime.llm import ensure_engine

    path = given_model(args)
    if config_kind(path / "config.json") is not None:
        return path
    terminal = sys.stderr.isatty()
    converted: list[Path] = []

    def converting(engine_dir: Path) -> None:
        converted.append(engine_dir)
        if terminal:
            say(f"converting {path} into the cache (once)...")

    try:
        engine = ensure_engine(path, args.dtype, show_progress=terminal, on_convert=converting)
    except BaseException:
        if converted and terminal:
            sys.stderr.write(ERASE_LINE)
            sys.stderr.flush()
        raise
    if terminal:  # a pipe or a log gets no status lines: an error after them would not be its one line
        say(f"engine: {engine}" if converted else f"{path}: cached engine {engine} (not converted again)")
    return engine


def say(text: str) -> None:
    """A status line on stderr."""
    print(f"[bestiary] {text}", file=sys.stderr, flush=True)
