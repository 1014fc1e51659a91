"""The CLI's one error path: every failure becomes one line on stderr and an exit code.

| what                                              | exit | line                                   |
|---------------------------------------------------|------|----------------------------------------|
| BestiaryError (bad path, flag, config, weights)   | 2    | `error: <message>`                     |
| EnvironmentFault (read-only / full disk, memory)  | 1    | `error: <message>`                     |
| UnicodeDecodeError / non-UTF-8 text argument      | 2    | `error: <flag or file>: not UTF-8 ...` |
| any other OSError                                 | 1    | `error: <file>: <strerror>`            |
| MemoryError, torch's out-of-memory RuntimeError   | 1    | `error: out of memory: ...`            |
| SIGINT / SIGTERM (even if a library wrapped it)   | 130 / 143 | `interrupted`                     |
| anything else (a bug)                             | 1    | `internal error: <type>: <message>`    |

Each line starts on a line of its own, even when a streamed answer stopped mid-line (core.format.stream_line).
BESTIARY_DEBUG=1 re-raises instead, so the traceback is printed. SIGINT and SIGTERM are turned into
an exception (`Interrupted`) from the script's first line on, so outputs are cleaned up as for
Ctrl-C, and remembered (core.format.interrupts): a signal a library swallowed still refuses every
commit and ends the command with 130 / 143.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from collections.abc import Iterator

from bestiary.core.format import interrupts, stream_line
from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.interrupts import Interrupted
from bestiary.core.format.resources import allocation_failed, out_of_memory_message

TEXT_FLAGS = ("input_text", "stop_words", "bad_words", "prompt", "system")  # text, not paths: must be UTF-8
DEBUG_ENV = "BESTIARY_DEBUG"


_received = interrupts.received  # signals seen while the current command ran (the same list object)


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """While the block runs (main thread only): SIGINT and SIGTERM raise `Interrupted` and are
    remembered (core.format.interrupts); handlers the script's entry installed stay as they are."""
    with interrupts.handled():
        yield


def check_text_args(args: argparse.Namespace) -> None:
    """Text flags with bytes that are not UTF-8 (argv's surrogate escapes) are a one-line error."""
    for name in TEXT_FLAGS:
        value = getattr(args, name, None)
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                byte = text[err.start].encode("utf-8", "surrogateescape")
                raise BestiaryError(f"--{name}: not valid UTF-8 text (byte 0x{byte.hex()} at character "
                                    f"{err.start}); pass UTF-8 text") from None


def exit_code_for(err: BaseException) -> int:
    """Print `err` as one line on stderr and return the exit code (see the module table)."""
    if _received and isinstance(err, Exception | KeyboardInterrupt):
        err = Interrupted(_received[0])  # a library may have wrapped the KeyboardInterrupt
    if isinstance(err, KeyboardInterrupt):
        stream_line.error_line("interrupted")
        return 128 + getattr(err, "signum", signal.SIGINT)
    if os.environ.get(DEBUG_ENV) == "1":
        raise err
    if isinstance(err, BestiaryError):
        line, code = f"error: {err}", err.exit_code
    elif isinstance(err, UnicodeDecodeError):
        line, code = f"error: input is not UTF-8 text ({err.reason} at byte {err.start}); pass UTF-8 text", 2
    elif isinstance(err, OSError):
        where = f"{err.filename}: " if err.filename else ""
        line, code = f"error: {where}{err.strerror or err}", 1
    elif allocation_failed(err):  # MemoryError, torch's allocators: the size asked and this process's limit
        line, code = f"error: {out_of_memory_message(err)}", 1
    else:
        line = f"internal error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        line, code = f"{line} (rerun with {DEBUG_ENV}=1 for the traceback)", 1
    stream_line.error_line(" ".join(line.split("\n")))
    return code
