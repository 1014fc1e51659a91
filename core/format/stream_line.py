"""Whether streamed text stopped mid-line, so that an error line written meanwhile starts a line of its own.

`bestiary run --streaming` and `bestiary chat` write an answer to stdout piece by piece, with no newline
until it ends. A failure reported meanwhile (a rank that died: core.runtime.worker_group; the CLI's one
error path: core.cli.failures) is a line on stderr, and a terminal shows both streams on one screen (as
`2>&1` puts them in one file): written as it is, it continues the half-written line ("One of the
mostbestiary: rank 1 ..."). So the streaming writers record here whether the last character they wrote
was not a newline (`write`, or `set_mid_line` around a writer of their own such as rich's Live), and every
error writer goes through `error_line`, which starts with a newline when the stream is mid-line.

The flag is set before a piece is written and cleared after one that ends its line: an error line
written from another thread (the rank watch thread) while a piece is being written may start with an
empty line, never glued to the text. No lock: an error writer must never wait on a blocked stdout. The
same holds when stdout is not a terminal: the shell still shows both streams on one screen.

Layer 0 of the core (docs/architecture.md): the runtime's rank watch and the CLI both write through it.
"""

from __future__ import annotations

import sys
from typing import TextIO

_state = {"mid_line": False}  # stdout's last character written by a streaming writer was not a newline


def mid_line() -> bool:
    """Whether the streamed text now stops mid-line."""
    return _state["mid_line"]


def set_mid_line(value: bool) -> None:
    """For a streaming writer of its own (rich's Live): True while it may leave stdout mid-line."""
    _state["mid_line"] = value


def write(text: str, stream: TextIO | None = None) -> None:
    """Write `text` to stdout (or `stream`) and flush it, remembering whether it left the line open."""
    if not text:
        return
    out = stream if stream is not None else sys.stdout
    _state["mid_line"] = True  # before the write: an error line written meanwhile starts a new line
    out.write(text)
    out.flush()
    _state["mid_line"] = not text.endswith("\n")


def fresh_line() -> str:
    """"\\n" when the streamed text stops mid-line (and the line counts as ended from now on), else ""."""
    if not _state["mid_line"]:
        return ""
    _state["mid_line"] = False
    return "\n"


def error_line(line: str, stream: TextIO | None = None) -> None:
    """Write `line` and a newline to stderr (or `stream`), on a line of its own, and flush it."""
    err = stream if stream is not None else sys.stderr
    err.write(f"{fresh_line()}{line}\n")
    err.flush()
