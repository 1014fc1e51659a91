"""The CLI's one error path: every failure becomes one line on stderr and an exit code.

| what                                              | exit | line                                   |
|---------------------------------------------------|------|----------------------------------------|
| BestiaryError (bad path, flag, config, weights)   | 2    | `error: <message>`                     |
| EnvironmentFault (read-only / full disk, memory)  | 1    | `error: <message>`                     |
| UnicodeDecodeError / non-UTF-8 text argument      | 2    | `error: <flag or file>: not UTF-8 ...` |
| any other OSError                                 | 1    | `error: <file>: <strerror>`            |
| MemoryError                                       | 1    | `error: out of memory ...`             |
| SIGINT / SIGTERM (even if a library wrapped it)   | 130 / 143 | `interrupted`                     |
| anything else (a bug)                             | 1    | `internal error: <type>: <message>`    |

BESTIARY_DEBUG=1 re-raises instead, so the traceback is printed. SIGTERM is turned into an
exception while a command runs, so output directories are cleaned up as for Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from bestiary.core.format.errors import BestiaryError

TEXT_FLAGS = ("input_text", "stop_words", "bad_words", "prompt", "system")  # text, not paths: must be UTF-8
DEBUG_ENV = "BESTIARY_DEBUG"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM while a command ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []  # signals seen while the current command ran


def _on_signal(signum: int, frame) -> None:
    _received.append(signum)
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """While the block runs (main thread only): SIGINT and SIGTERM raise `Interrupted`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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
        print("interrupted", file=sys.stderr)
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
    elif isinstance(err, MemoryError):
        line, code = "error: out of memory; use smaller limits (bestiary build --max_batch_size, --max_seq_len)", 1
    else:
        line = f"internal error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        line, code = f"{line} (rerun with {DEBUG_ENV}=1 for the traceback)", 1
    print(" ".join(line.split("\n")), file=sys.stderr)
    return code
