"""--json_schema / --json_object / --regex / --grammar / --choice: structured output from the command line
(`SamplingConfig.guided`, core.runtime.guided), shared by run and chat. At most one of them.

A mistake is one line naming the flag (and its file) and the reason, exit 2: a missing file, a file that
is not JSON or not a schema, and, once the engine's tokenizer is loaded, a schema, regex or grammar the
grammar compiler refuses (`check_guided`, before anything is generated).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from bestiary.core.cli.parsing import path_arg
from bestiary.core.format.config import read_text_file
from bestiary.core.format.errors import BestiaryError

if TYPE_CHECKING:
    from bestiary.core.runtime.guided import GuidedConfig
    from bestiary.core.runtime.llm import LLM


def add_guided_flags(parser: argparse.ArgumentParser) -> None:
    """The five flags, in one mutually exclusive group."""
    g = parser.add_argument_group("structured output (docs/sampling.md); at most one of these")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--json_schema", type=path_arg, default=None, metavar="FILE",
                   help="Each output is one JSON value valid under the JSON Schema in FILE (default: off).")
    m.add_argument("--json_object", action="store_true", help="Each output is one JSON object (default: off).")
    m.add_argument("--regex", default=None, metavar="PATTERN",
                   help="Each output fully matches PATTERN (Rust regex syntax; no lookaround) (default: off).")
    m.add_argument("--grammar", type=path_arg, default=None, metavar="FILE",
                   help="Each output is a sentence of the grammar in FILE: Lark (start rule `start`) or GBNF "
                        "(`::=`, start rule `root`) (default: off).")
    m.add_argument("--choice", nargs="+", default=None, metavar="TEXT",
                   help="Each output is exactly one of these strings (default: off).")


def guided_from_args(args: argparse.Namespace) -> tuple[GuidedConfig | None, str]:
    """(the GuidedConfig the flags ask for or None, the flag as errors name it: '--grammar g.lark')."""
    from pydantic import ValidationError

    from bestiary.core.runtime.guided import GuidedConfig

    if args.json_schema is not None:
        flag = f"--json_schema {args.json_schema}"
        fields: dict = {"json_schema": _schema(args.json_schema, flag)}
    elif args.json_object:
        flag, fields = "--json_object", {"json_object": True}
    elif args.regex is not None:
        flag, fields = f"--regex {args.regex!r}", {"regex": args.regex}
    elif args.grammar is not None:
        flag = f"--grammar {args.grammar}"
        fields = {"grammar": read_text_file(args.grammar, "--grammar")}
    elif args.choice is not None:
        flag, fields = "--choice", {"choice": args.choice}
    else:
        return None, ""
    beams = getattr(args, "num_beams", None) or 1
    if beams > 1:
        raise BestiaryError(f"{flag} with --num_beams {beams}: beam search cannot hold its beams to a grammar; "
                            "use --num_beams 1")
    try:
        return GuidedConfig(**fields), flag
    except ValidationError as err:
        reason = err.errors()[0]["msg"].removeprefix("Value error, ").removeprefix(f"{next(iter(fields))}: ")
        raise BestiaryError(f"{flag}: {reason}") from None


def _schema(path: str, flag: str) -> dict | bool:
    """The JSON Schema held by the file `path`: an object (or true / false)."""
    text = read_text_file(path, "--json_schema")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise BestiaryError(f"{flag}: not JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if not isinstance(schema, (dict, bool)):
        raise BestiaryError(f"{flag}: expected a JSON Schema (a JSON object), got a JSON {type(schema).__name__}")
    return schema


def check_guided(llm: LLM, guided: GuidedConfig | None, flag: str) -> None:
    """Compile the constraint over the engine's tokenizer now: a bad one is one line naming `flag`."""
    if guided is None:
        return
    grammars = llm.executor.grammars
    if grammars is None:
        raise BestiaryError(f"{flag}: structured output needs the engine's tokenizer; "
                            f"{llm.engine.directory} has none")
    try:
        grammars.check(guided)
    except BestiaryError as err:
        raise BestiaryError(f"{flag}: {str(err).removeprefix(f'guided {guided.kind}: ')}") from None
