"""What a path given by the user can be on this system, checked before anything is read or written.

A name (one component of a path) longer than its filesystem allows (NAME_MAX, 255 bytes on ext4,
xfs, btrfs and tmpfs), or a whole path longer than PATH_MAX (4,096 bytes on Linux), is refused by
every system call with ENAMETOOLONG ("File name too long"): that is the user's path, so it is a
one-line error naming the flag and exit code 2 (core/cli/failures.py), not a fault of the host.
An output's last name keeps `room` bytes free for the temporary name it is written under
(core.format.output_dir.temp_path), so that the temporary never fails where the output would not.
An output under a file (`--output_dir notes.txt/sub`) is refused the same way: the file is named.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_NAME_MAX = 255  # POSIX's usual NAME_MAX, where pathconf cannot say
DEFAULT_PATH_MAX = 4096  # Linux's PATH_MAX


def nearest_existing(path: Path) -> Path:
    """`path` itself or its nearest ancestor that exists (a file, a directory or a link); `path` is absolute."""
    return next((p for p in (path, *path.parents) if os.path.lexists(p)), Path(path.anchor))


def _limit(where: Path, name: str, default: int) -> int:
    """pathconf(`where`, `name`), or `default` where the system cannot say."""
    try:
        return int(os.pathconf(where, name))
    except (OSError, ValueError):
        return default


def shown(path: str | Path, width: int = 80) -> str:
    """`path` cut to `width` characters for a one-line message (its start and its end kept)."""
    text = str(path)
    return text if len(text) <= width else f"{text[: width // 2 - 1]}…{text[-(width // 2 - 1):]}"


def path_problem(path: str | Path, room: int = 0) -> str | None:
    """Why no system call can use `path` (a name past NAME_MAX, the last one keeping `room` bytes
    free, or the whole path past PATH_MAX), or None. Names are counted in bytes (os.fsencode)."""
    absolute = Path(os.path.abspath(path))
    where = nearest_existing(absolute)
    directory = where if where.is_dir() else where.parent
    size = len(os.fsencode(str(absolute)))
    path_max = _limit(directory, "PC_PATH_MAX", DEFAULT_PATH_MAX)
    if size >= path_max:
        return f"the path is {size:,} bytes long, more than the {path_max - 1:,} this system allows"
    name_max = _limit(directory, "PC_NAME_MAX", DEFAULT_NAME_MAX)
    names = absolute.parts[1:]
    for i, name in enumerate(names):
        limit = name_max - (room if i == len(names) - 1 else 0)
        if len(os.fsencode(name)) > limit:
            allowed = (f"the {limit} an output's name may have ({name_max} on this filesystem, less {room} for the "
                       "temporary name it is written under)" if limit < name_max else
                       f"the {limit} this filesystem allows")
            return f"the name {shown(name, 40)!r} is {len(os.fsencode(name))} bytes long, more than {allowed}"
    return None


def file_in_the_way(path: str | Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a directory (nothing can be created
    under it), else None."""
    where = nearest_existing(Path(os.path.abspath(path)).parent)
    return None if where.is_dir() else where
