"""How `bestiary` reads its command line: a parser whose errors are one line, and the types of flag values.

A mistake in a flag is one line on stderr and exit code 2, like every other user mistake
(core/cli/failures.py), with no usage block before it (`--help` shows that, unchanged):

    bestiary build: error: argument --max_seq_len: invalid positive_int value: 'x' (see bestiary build --help)

Integer flags are counts and sizes the engine keeps in 32-bit integers (TensorRT-LLM's SizeType32):
above INT32_MAX is refused here, by name, before it overflows a torch call. Thread counts stop at
MAX_THREADS. Path flags refuse a name longer than its filesystem allows (core.format.path_limits).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

from bestiary.core.format.build_config import INT32_MAX
from bestiary.core.format.path_limits import path_problem, shown

INT32_UNIT = " (the engine's counts are 32-bit integers)"
MAX_THREADS = 1024  # torch CPU threads (llama.cpp stops at 512): more is a typo, not a machine


def shown_default(value: object) -> str:
    """A default as it is typed on the command line: a list's items separated by spaces."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def worth_showing(action: argparse.Action) -> bool:
    """Whether --help shows the action's default: a value (not None, False, "" or an empty list, whose
    help says instead what leaving the flag out means), on an action that takes a value or is a switch."""
    default = action.default
    return (default is not argparse.SUPPRESS and default is not None and default is not False
            and default not in ("", [], ()) and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)))


class FlagHelpFormatter(argparse.HelpFormatter):
    """Every flag's help: the text given, then `(default: VALUE)` when the default is worth showing
    (`worth_showing`) and the text does not say it already (it holds %(default)s or the word "default"),
    then `(required)` for an option the parser requires. tests/cli/test_help_text.py checks every flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if worth_showing(action) and "%(default)" not in text and "default" not in text.lower():
            text += f" (default: {shown_default(action.default).replace('%', '%%')})"
        if action.required and action.option_strings:
            text += " (required)"
        return text.strip()


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line `PROG: error: MESSAGE (see PROG --help)` on stderr,
    exit code 2, and whose --help shows defaults and required flags (FlagHelpFormatter). Subparsers made
    by add_subparsers are of the same class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", FlagHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        text = " ".join(line.strip() for line in message.splitlines() if line.strip())
        self.exit(2, f"{self.prog}: error: {text} (see {self.prog} --help)\n")


def int_range(low: int, high: int = INT32_MAX, name: str | None = None, unit: str = INT32_UNIT) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` (`unit` follows the upper bound in the message);
    `name` is what argparse's "invalid NAME value" says (default: positive_int for low 1, non_negative_int
    for low 0)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            expected = {1: "a positive integer", 0: "an integer >= 0"}.get(low, f"an integer >= {low}")
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{shown(text, 40)!r}: expected at most {high:,}{unit}")
        return value

    parse.__name__ = name or {1: "positive_int", 0: "non_negative_int"}.get(low, "int")
    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)
thread_count = int_range(1, MAX_THREADS, "thread_count", unit=" threads")


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, a ratio)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{shown(text, 40)!r}: expected a finite number > 0")
    return value


def path_arg(text: str) -> str:
    """An argparse type for a path flag: the text as given, unless no system call could use it (a name
    longer than its filesystem allows, a path past PATH_MAX)."""
    problem = path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{shown(text)!r}: {problem}")
    return text


path_arg.__name__ = "path"
