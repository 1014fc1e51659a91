"""May bestiary write here? The checks every output path passes before anything is written.

A command writes into a missing or empty directory, or replaces an earlier bestiary output of
the same kind (a checkpoint by a checkpoint, an engine by an engine). Everything else is
refused with one line, and there is no override:

- a non-empty directory that is not such an output (a foreign file, a subfolder, another kind);
- the current directory or any of its ancestors, $HOME or any of its ancestors (`/` included);
- a source of the command, or any directory containing one (`--output_dir` = `--model_dir`,
  a checkpoint as its own engine dir);
- a mount point (it cannot be renamed over).

A bestiary output is recognised by its own files only: `config.json` holding bestiary's
fields (checkpoint: `architecture` and `mapping`; engine: `format_version`,
`pretrained_config`, `build_config`), its `rank{N}.safetensors` and the tokenizer files,
and nothing else.

Temporary directories are `.NAME.tmp-PID` (and `.NAME.old-PID` for a replaced output while it
is deleted) beside the output, each holding a `TEMP_MARKER` file while it is being written;
those of processes that no longer run are removed by the next write into the same parent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from bestiary.core.format.errors import BestiaryError

OUTPUT_KINDS = ("checkpoint", "engine")
OUTPUT_FILES = re.compile(r"^(config\.json|rank\d+\.safetensors|tokenizer\.json|tokenizer_config\.json)$")
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<what>tmp|old)-(?P<pid>\d+)$")
TEMP_MARKER = ".bestiary-partial"


def config_kind(config_json: Path) -> str | None:
    """"checkpoint" or "engine" when `config_json` is a config.json bestiary wrote, else None."""
    try:
        data = json.loads(Path(config_json).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if {"format_version", "pretrained_config", "build_config"} <= data.keys():
        return "engine"
    if {"architecture", "mapping"} <= data.keys() and "pretrained_config" not in data:
        return "checkpoint"
    return None


def output_kind(directory: Path) -> str | None:
    """"checkpoint" or "engine" when `directory` holds only a bestiary output of that kind, else None."""
    try:
        names = [p.name for p in Path(directory).iterdir()]
    except OSError:
        return None
    if not all(OUTPUT_FILES.match(n) for n in names):
        return None
    return config_kind(Path(directory) / "config.json")


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.abspath(path)))


def _contains(outer: Path, inner: Path) -> bool:
    """`inner` is `outer` or lies inside it."""
    return inner == outer or outer in inner.parents


def _check_not_protected(out: Path, flag: str, sources: Iterable[str | Path]) -> None:
    """Refuse the current directory, $HOME, their ancestors, and anything containing a source."""
    cwd = _real(os.getcwd())
    if _contains(out, cwd):
        what = "the current directory" if out == cwd else "an ancestor of the current directory"
        raise BestiaryError(f"{flag} {out}: is {what}; choose a new or empty directory")
    home = _real(Path.home())
    if _contains(out, home):
        what = "your home directory" if out == home else "an ancestor of your home directory"
        raise BestiaryError(f"{flag} {out}: is {what}; choose a new or empty directory")
    for source in sources:
        src = _real(source)
        if _contains(out, src):
            what = "the source" if out == src else f"a directory containing the source {src}"
            raise BestiaryError(f"{flag} {out}: is {what}; choose a new or empty directory")


def check_output_dir(output_dir: str | Path, kind: str, sources: Iterable[str | Path] = (),
                     flag: str = "--output_dir") -> Path:
    """The absolute output path, if a `kind` output may be written there; else a one-line BestiaryError."""
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {OUTPUT_KINDS}")
    out = _real(output_dir)
    _check_not_protected(out, flag, sources)
    if not out.exists():
        return out
    if not out.is_dir():
        raise BestiaryError(f"{flag} {out}: exists and is not a directory")
    if os.path.ismount(out):
        raise BestiaryError(f"{flag} {out}: is a mount point; write into a new directory inside it")
    try:
        entries = sorted(p.name for p in out.iterdir())
    except OSError as err:
        raise BestiaryError(f"{flag} {out}: cannot be listed ({err.strerror})") from None
    if not entries:
        return out
    found = output_kind(out)
    if found == kind:
        return out
    if found is not None:
        raise BestiaryError(f"{flag} {out}: holds a bestiary {found}, not a {kind}; choose another directory")
    foreign = next((n for n in entries if not OUTPUT_FILES.match(n)), entries[0])
    raise BestiaryError(
        f"{flag} {out}: not empty and not a bestiary {kind} (it holds {foreign!r}); choose a new or empty directory"
    )


def check_output_file(path: str | Path, sources: Iterable[str | Path] = (), flag: str = "--output",
                      replaceable: Callable[[Path], bool] | None = None) -> Path:
    """The absolute path of a single output file, if it may be written; else a one-line BestiaryError.

    An existing file is replaced only when `replaceable(path)` says it is an earlier output of
    the same kind; a source, a directory, or a file inside the current directory's ancestors'
    protected set is refused as for directories."""
    out = _real(path)
    for source in sources:
        if _real(source) == out:
            raise BestiaryError(f"{flag} {out}: is the source; choose another file name")
    _check_not_protected(out, flag, sources)
    if out.is_dir():
        raise BestiaryError(f"{flag} {out}: is a directory; expected a file name")
    if out.exists() and not (replaceable is not None and replaceable(out)):
        raise BestiaryError(f"{flag} {out}: exists and was not written by bestiary; choose another file name")
    if not out.parent.is_dir():
        raise BestiaryError(f"{flag} {out}: directory {out.parent} does not exist")
    return out


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_dirs(parent: Path) -> list[Path]:
    """Remove the `.NAME.tmp-PID` / `.NAME.old-PID` directories in `parent` whose process is gone.

    A tmp dir counts only while it holds TEMP_MARKER; an old dir only when it is a bestiary
    output (what a replace was deleting). Returns what was removed."""
    removed: list[Path] = []
    try:
        children = list(Path(parent).iterdir())
    except OSError:
        return removed
    for child in children:
        m = TEMP_NAME.match(child.name)
        if not m or not child.is_dir() or child.is_symlink() or pid_alive(int(m["pid"])):
            continue
        ours = (child / TEMP_MARKER).is_file() if m["what"] == "tmp" else output_kind(child) is not None
        if ours:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed
