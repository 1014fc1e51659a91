"""Rich progress bars on stderr (stdout stays for generated text)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

STDERR = Console(stderr=True)


@contextlib.contextmanager
def progress(enabled: bool = True) -> Iterator[Progress]:
    """A Progress on stderr; disabled (no output) when `enabled` is False. The bar stays when the block
    ends normally and is erased when it raises, so an error is the one line the CLI prints after it."""
    bar = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=STDERR, disable=not enabled, transient=False,
    )
    with bar:
        try:
            yield bar
        except BaseException:
            bar.live.transient = True
            raise
