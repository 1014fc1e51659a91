"""The per-user cache directory: on-the-fly conversions, the demo's model, compiled CPU kernels.

Location: $BESTIARY_CACHE, else $XDG_CACHE_HOME/bestiary, else ~/.cache/bestiary.

`LLM(source)` converts and builds a source into `engines/KEY` (its checkpoint in
`checkpoints/KEY`), where KEY hashes the source path, the dtype and every source file's
path, size and mtime_ns (weights, configs, tokenizer files), so any change to any of them
converts again. `engines/KEY.json` records the source; the entries an older state of the
same source left are removed when it is converted again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENTRY_KINDS = ("engines", "checkpoints", "demo", "cpu-kernels", "dense-hf")  # what `bestiary cache clear` removes


def cache_dir() -> Path:
    """$BESTIARY_CACHE, else $XDG_CACHE_HOME/bestiary, else ~/.cache/bestiary."""
    if os.environ.get("BESTIARY_CACHE"):
        return Path(os.environ["BESTIARY_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bestiary"


def file_stamps(files: list[Path]) -> list[tuple[str, int, int]]:
    """(absolute path, size, mtime_ns) of each file: what a change to a source shows in."""
    stamps = []
    for f in files:
        st = Path(f).stat()
        stamps.append((str(Path(f).absolute()), st.st_size, st.st_mtime_ns))
    return stamps


def source_key(source: Path, files: list[Path], dtype: str) -> str:
    """The cache key of converting `source` (read from `files`) to `dtype`."""
    blob = json.dumps([str(Path(source).absolute()), dtype, file_stamps(files)])
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def record_entry(key: str, source: Path, dtype: str) -> None:
    """Write engines/KEY.json and remove the entries of earlier states of the same source and dtype."""
    engines = cache_dir() / "engines"
    me = {"source": str(Path(source).absolute()), "dtype": dtype}
    for sidecar in engines.glob("*.json"):
        if sidecar.stem != key and _read(sidecar) == me:
            for kind in ("engines", "checkpoints"):
                shutil.rmtree(cache_dir() / kind / sidecar.stem, ignore_errors=True)
            sidecar.unlink(missing_ok=True)
    (engines / f"{key}.json").write_text(json.dumps(me) + "\n")


def _read(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when it is unreadable, malformed or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class CacheEntry:
    """One thing in the cache: kind (ENTRY_KINDS), name, where it came from, bytes on disk."""

    kind: str
    name: str
    source: str
    path: Path
    size: int


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def cache_entries() -> list[CacheEntry]:
    """Everything under the cache's known folders."""
    entries = []
    for kind in ENTRY_KINDS:
        folder = cache_dir() / kind
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if kind == "engines" and path.suffix == ".json":
                continue
            info = _read(cache_dir() / "engines" / f"{path.name}.json") if kind in ("engines", "checkpoints") else None
            source = f"{info['source']} ({info['dtype']})" if isinstance(info, dict) and "source" in info else ""
            entries.append(CacheEntry(kind, path.name, source, path, _size(path)))
    return entries


def clear_cache() -> int:
    """Remove the cache's known folders (nothing else under $BESTIARY_CACHE); returns the bytes freed."""
    freed = sum(e.size for e in cache_entries())
    for kind in ENTRY_KINDS:
        shutil.rmtree(cache_dir() / kind, ignore_errors=True)
    return freed
