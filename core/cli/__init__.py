"""bestiary.core.cli: the `bestiary` command line (`main`), its handlers and the demo.

Handlers import what they run inside themselves, so `--help` starts fast. Nothing imports cli.

`main` here is the script's entry (`bestiary = "bestiary.core.cli:main"`, `python -m bestiary`): its
first act, before any heavy import, installs the SIGINT / SIGTERM handlers of core.format.interrupts,
so a Ctrl-C at any moment ends as one line `interrupted` and exit code 130 (143 for SIGTERM), never a
traceback; once the command is over (its exit code decided) the entry ignores both signals, so one
during the interpreter's teardown neither prints a traceback nor kills a finished run.
core.cli.main.main runs one command (and is what tests call in-process).

Layer 7 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers, quant, lora, runtime, convert, bench, serve.
"""

from __future__ import annotations

import signal

from bestiary.core.format import interrupts, stream_line

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The `bestiary` script: signals handled from the first line, then core.cli.main.main."""
    try:
        interrupts.install()  # inside the try: a signal right after the first handler is in place is ours
        from bestiary.core.cli.main import main as run_command  # (the submodule then shadows this name)

        return run_command(argv)
    except KeyboardInterrupt as err:  # before the command's own error path began, or after it ended
        interrupts.ignore_from_now()
        stream_line.error_line("interrupted")  # on a line of its own, after text streamed mid-line
        return 128 + getattr(err, "signum", signal.SIGINT)
    finally:
        interrupts.ignore_from_now()  # the exit code is decided: a late signal changes nothing
