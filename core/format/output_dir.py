"""What bestiary may replace or delete: one rule for every command that writes (convert, build,
export, LoRA convert, the cache and `bestiary cache clear`).

bestiary replaces or deletes only what carries its own mark, and nothing else, ever:

- a finished output directory is recognised by its own files only (`output_kind`): a checkpoint
  or an engine by a `config.json` holding bestiary's fields (checkpoint: `architecture` and
  `mapping`; engine: `format_version`, `pretrained_config`, `build_config`), its
  `rank{N}.safetensors`, the tokenizer files and (engine) `lora/{N}.safetensors`; a LoRA
  conversion, whose files are PEFT's or TensorRT-LLM's, by an `OUTPUT_MARKER` file naming its kind
  beside those files. Anything more (a README, a subfolder) makes the directory foreign;
- a single file (export's .flm) by a mark in its own header, which the writer's `replaceable`
  check reads (`check_output_file`);
- a temporary directory by its name `.NAME.bestiary-tmp-PID-TOKEN` (`.NAME.bestiary-old-PID-TOKEN`
  for an earlier output while it is deleted) AND a `TEMP_MARKER` file in it that names the same
  PID and TOKEN and this host. Single files are written inside such a directory too. The name
  alone never counts: a user's `.ckpt.old-20241128` or `.m.flm.tmp-123` is never touched.
  The temporaries of processes that no longer run on this host are removed by the next write
  into the same parent (`remove_stale_temps`).

Where a command may write at all (never the current directory, $HOME or their ancestors, a source
or what contains one, a mount point, a foreign non-empty directory) is `check_output_dir` /
`check_output_file`; the writing itself, under a temporary name and committed by one rename, is
core.format.staging.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.path_limits import file_in_the_way, path_problem, shown

OUTPUT_KINDS = ("checkpoint", "engine", "lora")
KIND_LABELS = {"checkpoint": "checkpoint", "engine": "engine", "lora": "LoRA conversion"}
OUTPUT_FILES = re.compile(r"^(config\.json|rank\d+\.safetensors|tokenizer\.json|tokenizer_config\.json)$")
ENGINE_LORA_DIR, ENGINE_LORA_FILES = "lora", re.compile(r"^\d+\.safetensors$")  # build --lora_dir (core.lora.bundle)
OUTPUT_MARKER = ".bestiary-output"  # {"bestiary": KIND}: outputs whose files are not bestiary's own format
MARKED_FILES = {  # what an output of a marked kind may hold beside OUTPUT_MARKER
    "lora": re.compile(r"^(adapter_config\.json|adapter_model\.safetensors|model\.lora_(weights|config)\.npy)$"),
}
TEMP_MARKER = ".bestiary-partial"  # {"bestiary": "temp", "pid", "token", "host"}
TEMP_MAGIC = "temp"
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.bestiary-(?P<what>tmp|old)-(?P<pid>\d+)-(?P<token>[0-9a-f]{8})$")
LEGACY_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")  # older bestiary's: removed only with its marker


def config_kind(config_json: Path) -> str | None:
    """"checkpoint" or "engine" when `config_json` is a config.json bestiary wrote, else None."""
    data = _json_object(config_json)
    if data is None:
        return None
    if {"format_version", "pretrained_config", "build_config"} <= data.keys():
        return "engine"
    if {"architecture", "mapping"} <= data.keys() and "pretrained_config" not in data:
        return "checkpoint"
    return None


def _json_object(path: Path) -> dict[str, object] | None:
    """The JSON object in the regular file `path`, or None (missing, a symlink, unreadable, not an object)."""
    try:
        if Path(path).is_symlink():
            return None
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _names(directory: Path) -> list[str] | None:
    try:
        return [p.name for p in Path(directory).iterdir()]
    except OSError:
        return None


def output_kind(directory: Path) -> str | None:
    """"checkpoint", "engine" or "lora" when `directory` holds only a bestiary output of that kind, else None."""
    directory = Path(directory)
    names = _names(directory)
    if not names or directory.is_symlink():
        return None
    if OUTPUT_MARKER in names:
        return _marked_kind(directory, names)
    rest = [n for n in names if not OUTPUT_FILES.match(n)]
    if rest and rest != [ENGINE_LORA_DIR]:
        return None
    kind = config_kind(directory / "config.json")
    if rest and (kind != "engine" or not _engine_lora_dir(directory / ENGINE_LORA_DIR)):
        return None
    return kind


def _engine_lora_dir(directory: Path) -> bool:
    """An engine's lora/: a real directory of `{N}.safetensors` files."""
    names = _names(directory)
    return not directory.is_symlink() and bool(names) and all(ENGINE_LORA_FILES.match(n) for n in names or [])


def _marked_kind(directory: Path, names: list[str]) -> str | None:
    """The kind OUTPUT_MARKER names, when the directory holds only that kind's files beside it."""
    marker = _json_object(directory / OUTPUT_MARKER)
    kind = marker.get("bestiary") if marker is not None else None
    if not isinstance(kind, str) or kind not in MARKED_FILES:
        return None
    files = [n for n in names if n != OUTPUT_MARKER]
    return kind if files and all(MARKED_FILES[kind].match(n) for n in files) else None


def write_output_marker(directory: Path, kind: str) -> None:
    """Mark `directory` (being written) as a bestiary output of the marked `kind`."""
    if kind not in MARKED_FILES:
        raise ValueError(f"kind {kind!r}: expected one of {sorted(MARKED_FILES)}")
    (Path(directory) / OUTPUT_MARKER).write_text(json.dumps({"bestiary": kind}) + "\n")


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


TEMP_ROOM = len("..bestiary-tmp--") + 7 + 8  # what temp_path adds to a name: a pid (pid_max <= 2**22) and a token


def check_output_path(out: Path, flag: str) -> None:
    """A path no output can be written to (a name too long, the temporary name's room kept, or a file
    where a directory must be): a one-line BestiaryError naming `flag` (core.format.path_limits)."""
    problem = path_problem(out, room=TEMP_ROOM)
    if problem:
        raise BestiaryError(f"{flag} {shown(out)}: {problem}; choose a shorter name")
    blocking = file_in_the_way(out)
    if blocking is not None:
        raise BestiaryError(f"{flag} {out}: {blocking} is not a directory; choose a path under a directory")


def check_output_dir(output_dir: str | Path, kind: str, sources: Iterable[str | Path] = (),
                     flag: str = "--output_dir") -> Path:
    """The absolute output path, if a `kind` output may be written there; else a one-line BestiaryError."""
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {OUTPUT_KINDS}")
    out = _real(output_dir)
    check_output_path(out, flag)
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
        raise BestiaryError(f"{flag} {out}: holds a bestiary {KIND_LABELS[found]}, not a {KIND_LABELS[kind]}; "
                            "choose another directory")
    own = MARKED_FILES.get(kind, OUTPUT_FILES)
    foreign = next((n for n in entries if not own.match(n)), entries[0])
    raise BestiaryError(f"{flag} {out}: not empty and not a bestiary {KIND_LABELS[kind]} (it holds {foreign!r}); "
                        "choose a new or empty directory")


def check_output_file(path: str | Path, sources: Iterable[str | Path] = (), flag: str = "--output",
                      replaceable: Callable[[Path], bool] | None = None) -> Path:
    """The absolute path of a single output file, if it may be written; else a one-line BestiaryError.

    An existing file is replaced only when `replaceable(path)` says it is an earlier output of
    the same kind; a source, a directory, or a file inside the current directory's ancestors'
    protected set is refused as for directories."""
    out = _real(path)
    check_output_path(out, flag)
    for source in sources:
        if _real(source) == out:
            raise BestiaryError(f"{flag} {out}: is the source; choose another file name")
    _check_not_protected(out, flag, sources)
    if out.is_dir():
        raise BestiaryError(f"{flag} {out}: is a directory; expected a file name")
    if (out.exists() or out.is_symlink()) and not (replaceable is not None and replaceable(out)):
        raise BestiaryError(f"{flag} {out}: exists and was not written by bestiary; choose another file name "
                            "(bestiary replaces only its own earlier output)")
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
    except (OverflowError, ValueError):  # not a pid this system can have
        return False
    return True


def host() -> str:
    """This machine's name: a temp marker's PID means something on its own host only."""
    return os.uname().nodename


def temp_path(target: Path, what: str, token: str) -> Path:
    """`.NAME.bestiary-{what}-PID-TOKEN` beside `target` (what: "tmp" or "old")."""
    return Path(target).parent / f".{Path(target).name}.bestiary-{what}-{os.getpid()}-{token}"


def write_temp_marker(directory: Path, token: str) -> None:
    """Mark `directory` (named by `temp_path` with `token`) as this process's temporary."""
    marker = {"bestiary": TEMP_MAGIC, "pid": os.getpid(), "token": token, "host": host()}
    (Path(directory) / TEMP_MARKER).write_text(json.dumps(marker) + "\n")


@dataclass(frozen=True)
class Temp:
    """A temporary directory bestiary made: whose process (pid on host) and for which output."""

    path: Path
    name: str
    pid: int
    host: str


def our_temp(path: Path) -> Temp | None:
    """The Temp `path` is, when its name and its TEMP_MARKER agree (same pid, token, a real
    directory, not a symlink); None for anything else, whatever its name."""
    path = Path(path)
    m = TEMP_NAME.match(path.name)
    if m is None or path.is_symlink() or not path.is_dir():
        return None
    marker = _json_object(path / TEMP_MARKER)
    if marker is None or marker.get("bestiary") != TEMP_MAGIC or marker.get("token") != m["token"]:
        return None
    pid, where = marker.get("pid"), marker.get("host")
    if type(pid) is not int or pid != int(m["pid"]) or not isinstance(where, str):
        return None
    return Temp(path, m["name"], pid, where)


def _legacy_temp(path: Path) -> Temp | None:
    """A `.NAME.tmp-PID` directory of an older bestiary: its marker file holds exactly PID."""
    m = LEGACY_TEMP_NAME.match(path.name)
    if m is None or path.is_symlink() or not path.is_dir() or (path / TEMP_MARKER).is_symlink():
        return None
    try:
        text = (path / TEMP_MARKER).read_text()
    except (OSError, ValueError):
        return None
    return Temp(path, m["name"], int(m["pid"]), host()) if text.strip() == m["pid"] else None


def stale(temp: Temp | None) -> bool:
    """A temporary of a process of this host that no longer runs."""
    return temp is not None and temp.host == host() and not pid_alive(temp.pid)


def remove_stale_temps(parent: Path) -> list[Path]:
    """Remove the temporaries in `parent` (ours by name and marker) whose process is gone; returns them."""
    removed: list[Path] = []
    try:
        children = list(Path(parent).iterdir())
    except OSError:
        return removed
    for child in children:
        if stale(our_temp(child) or _legacy_temp(child)):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


remove_stale_temp_dirs = remove_stale_temps  # its older name

