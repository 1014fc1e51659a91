"""Writing an output under a temporary name beside its place, and committing it with one rename.

`staged_dir(target, ...)` yields a fresh `.NAME.bestiary-tmp-PID-TOKEN/` (marked by TEMP_MARKER:
core.format.output_dir has the rule); `staged_file(target, ...)` yields a path inside one. When the
block succeeds, `recheck()` runs once more (the place may have changed while the output was
written) and the output is renamed into place inside `interrupts.committing()`: refused after a
Ctrl-C or SIGTERM, never cut in half by one. An earlier output directory is first renamed aside to
`.NAME.bestiary-old-PID-TOKEN/` (marked too) and deleted after the rename. Any error, Ctrl-C or
SIGTERM removes the temporary and leaves the earlier output as it was; a process killed with
SIGKILL leaves a marked temporary that the next write into the same parent removes.

An OSError (read-only or full filesystem) becomes an EnvironmentFault naming `flag` and the target,
never the temporary name.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from bestiary.core.format import interrupts
from bestiary.core.format.errors import EnvironmentFault
from bestiary.core.format.output_dir import TEMP_MARKER, remove_stale_temps, temp_path, write_temp_marker


def _token() -> str:
    return secrets.token_hex(4)


def _new_temp(target: Path, flag: str) -> Path:
    """Create the parents, remove stale temporaries beside `target`, and make a marked temp dir."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(target.parent)
        token = _token()
        tmp = temp_path(target, "tmp", token)
        tmp.mkdir()
    except OSError as err:
        raise EnvironmentFault(f"{flag} {target}: cannot write there ({err.strerror or err})") from None
    try:
        write_temp_marker(tmp, token)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EnvironmentFault(f"{flag} {target}: cannot write there ({err.strerror or err})") from None
    return tmp


def _failed(err: OSError, flag: str, target: Path) -> EnvironmentFault:
    return EnvironmentFault(f"{flag} {target}: writing failed ({err.strerror or err}); nothing was written")


@contextlib.contextmanager
def staged_dir(target: Path, recheck: Callable[[], object], flag: str = "--output_dir") -> Iterator[Path]:
    """Yield a temp dir that becomes `target` (replacing an earlier output) only if the block succeeds."""
    target = Path(target)
    tmp = _new_temp(target, flag)
    try:
        yield tmp
        recheck()
        with interrupts.committing():
            (tmp / TEMP_MARKER).unlink()
            _replace_dir(tmp, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise _failed(err, flag, target) from None
        raise


def _replace_dir(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`; an existing `target` is renamed aside (and marked) first, deleted after."""
    old = move_aside(target) if os.path.lexists(target) else None
    try:
        tmp.rename(target)
    except OSError:
        if old is not None:
            (old / TEMP_MARKER).unlink(missing_ok=True)
            old.rename(target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def move_aside(path: Path) -> Path:
    """Rename the directory `path` to a marked `.NAME.bestiary-old-PID-TOKEN` beside it (one atomic step:
    never half there); its new path. Unmarked when the marker cannot be written: then it is kept."""
    token = _token()
    old = temp_path(path, "old", token)
    path.rename(old)
    with contextlib.suppress(OSError):
        write_temp_marker(old, token)
    return old


def delete_dir(path: Path) -> None:
    """Delete the directory `path` (which the caller has checked is bestiary's): renamed aside first, so an
    interrupt or a crash during the deletion leaves a marked temporary, never a half-deleted `path`."""
    with interrupts.committing():
        old = move_aside(path)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_file(target: Path, recheck: Callable[[], object], flag: str = "--output_file") -> Iterator[Path]:
    """Yield a path (inside a marked temp dir) that replaces the file `target` only if the block succeeds."""
    target = Path(target)
    tmp = _new_temp(target, flag)
    try:
        yield tmp / target.name
        recheck()
        with interrupts.committing():
            os.replace(tmp / target.name, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise _failed(err, flag, target) from None
        raise
    shutil.rmtree(tmp, ignore_errors=True)
