"""The per-user cache directory: on-the-fly conversions, the demo's model, compiled CPU kernels.

Location: $BESTIARY_CACHE, else $XDG_CACHE_HOME/bestiary, else ~/.cache/bestiary.

`LLM(source)` converts and builds a source into `engines/KEY` (its checkpoint in
`checkpoints/KEY`). KEY comes from the CONTENT of the source, never from its times, so no
in-place edit, however its times are set, serves a stale conversion:

- KEY hashes the dtype, whether the source is a directory or a file, and for every file the
  conversion reads (`sources.source_files`: weights, configs, tokenizer files) its name relative
  to the source, its size and the sha256 of its bytes. The source's absolute path is not in KEY:
  two copies of one model share one conversion, and a moved model is hashed again, not converted.
- Each file's sha256 is remembered in `digests/index.json`, keyed by the file's real path and
  checked against its stamp (st_dev, st_ino, size, mtime_ns, ctime_ns): an unchanged stamp reuses
  the digest without reading a byte (a warm start stats the files and reads the small index),
  any changed field hashes the file again. ctime is set by the kernel on every write (and on
  rename, chmod, link, utime); no user call sets it, so a same-size rewrite whose mtime is put
  back with os.utime still changes the stamp. A digest is not remembered when the file's ctime is
  less than RACY_NS before its hashing began (a second write in the same clock tick would leave
  the stamp as it was: git's "racy clean" case), nor when its stamp changed while it was read.
  Filesystems whose ctime does not change on a write (rare FUSE or network mounts) would defeat
  the index: `bestiary cache clear` removes it with the rest.
- The index is written whole to a temp name beside it (`.index.json.tmp-*`, left ones older than
  TEMP_MAX_AGE_S are removed) and renamed over it: never half-written. An index that is unreadable,
  malformed, of another version or not bestiary's counts as empty, and a malformed entry is dropped,
  never trusted. It keeps only the files that still exist with the stamp recorded. Two processes
  writing it at once lose at most each other's new digests (hashed again next time); a cache that
  cannot be written only loses the reuse.
- Hashing streams each file in CHUNK_BYTES reads, up to HASH_THREADS files at once (reads and
  hashlib release the GIL); a progress bar on stderr appears once hashing has run PROGRESS_AFTER_S
  and stderr is a terminal. sha256 is hashlib's fastest digest where the CPU has SHA extensions
  (about 0.8-2 GB/s a core) and the one the HF hub names its blobs by; no dependency is added.

`engines/KEY.json` records the source path and dtype that made the entry; when that source
converts to a new KEY, the entries its earlier state left are removed. `ensure_engine`
(core.runtime.llm) compares the files' stamps after converting with those before and discards an
entry whose source changed while it was converted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.output_dir import our_temp, output_kind, stale
from bestiary.core.format.staging import delete_dir

# What `bestiary cache clear` removes.
ENTRY_KINDS = ("engines", "checkpoints", "demo", "cpu-kernels", "dense-hf", "digests")
KEY_VERSION = 2  # 1: the source path and each file's (path, size, mtime_ns)
INDEX_FORMAT, INDEX_VERSION = "bestiary-file-digests", 1
CHUNK_BYTES = 8 << 20
HASH_THREADS = 4
RACY_NS = 2_000_000_000
PROGRESS_AFTER_S = 1.0
TEMP_MAX_AGE_S = 600


def cache_dir() -> Path:
    """$BESTIARY_CACHE, else $XDG_CACHE_HOME/bestiary, else ~/.cache/bestiary."""
    if os.environ.get("BESTIARY_CACHE"):
        return Path(os.environ["BESTIARY_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bestiary"


@dataclass(frozen=True)
class FileStamp:
    """What stat says of one file (its real path): any write to it changes ctime_ns."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    def fields(self) -> list[int]:
        """dev, ino, size, mtime_ns, ctime_ns: the index's record of it."""
        return [self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns]


def file_stamp(path: str | Path) -> FileStamp:
    """The stamp of `path` (symlinks resolved: the file that is read)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):  # a device (/dev/zero) or a pipe would be hashed forever
        raise BestiaryError(f"{path}: not a regular file; expected a model file or directory")
    return FileStamp(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_stamps(files: Iterable[str | Path]) -> list[FileStamp]:
    """The stamp of each file: comparing two lists tells whether any file was written in between."""
    return [file_stamp(f) for f in files]


def source_key(source: str | Path, files: list[Path], dtype: str, show_progress: bool = True) -> str:
    """The cache key of converting `source` (read from `files`) to `dtype`: a hash of the dtype, the
    source's kind and each file's relative name, size and sha256 (the module docstring says how)."""
    source = Path(source).absolute()
    root = source if source.is_dir() else source.parent
    stamped = file_digests(files, show_progress)
    parts = [[_relative(Path(f), root), stamp.size, digest] for f, (stamp, digest) in zip(files, stamped)]
    blob = json.dumps([KEY_VERSION, dtype, "dir" if source.is_dir() else "file", parts])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _relative(path: Path, root: Path) -> str:
    """`path` relative to `root` (posix), or its absolute path when it is not under `root`."""
    path = path.absolute()
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def file_digests(files: Iterable[str | Path], show_progress: bool = True) -> list[tuple[FileStamp, str]]:
    """(stamp, sha256) of each file: remembered ones where the stamp is unchanged, the others hashed
    (and remembered when they may be: `_rememberable`)."""
    stamps = file_stamps(files)
    known = load_index()
    digests = {s.path: known[s.path][1] for s in stamps if s.path in known and known[s.path][0] == s}
    todo = list({s.path: s for s in stamps if s.path not in digests}.values())
    started = time.time_ns()
    hashed = _hash_all(todo, show_progress)
    fresh = {s.path: (s, hashed[s.path]) for s in todo if _rememberable(s, started)}
    if fresh:
        save_index(fresh)
    digests.update(hashed)
    return [(s, digests[s.path]) for s in stamps]


def _rememberable(stamp: FileStamp, started_ns: int) -> bool:
    """Whether the digest of `stamp`'s file may be reused while its stamp stays: it was not written in
    the RACY_NS before hashing began, nor while it was read."""
    return started_ns - stamp.ctime_ns >= RACY_NS and _unchanged(stamp)


def _unchanged(stamp: FileStamp) -> bool:
    """Whether the file still exists with this stamp."""
    try:
        return file_stamp(stamp.path) == stamp
    except OSError:
        return False


def file_sha256(path: str, meter: _Meter, stop: threading.Event) -> str:
    """The sha256 of the file's bytes, read in CHUNK_BYTES pieces ("" when `stop` is set first)."""
    digest, buf = hashlib.sha256(), bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while (n := f.readinto(buf)) and not stop.is_set():
                digest.update(view[:n])
                meter.advance(n)
    except OSError as err:
        raise BestiaryError(f"{path}: cannot read it to hash it: {err.strerror or err}") from None
    return "" if stop.is_set() else digest.hexdigest()


def _hash_all(stamps: list[FileStamp], show_progress: bool) -> dict[str, str]:
    """sha256 of each stamp's file by path, up to HASH_THREADS files at once; an interrupt stops
    every reader within one chunk."""
    if not stamps:
        return {}
    stop = threading.Event()
    workers = min(HASH_THREADS, len(stamps), os.cpu_count() or 1)
    with _Meter(sum(s.size for s in stamps), show_progress) as meter:
        pool = ThreadPoolExecutor(workers, thread_name_prefix="bestiary-hash")
        try:
            futures = {s.path: pool.submit(file_sha256, s.path, meter, stop) for s in stamps}
            return {path: future.result() for path, future in futures.items()}
        finally:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)


class _Meter:
    """Counts hashed bytes (from any thread); a rich bar on stderr shows them once hashing has run
    PROGRESS_AFTER_S, when `enabled` and stderr is a terminal."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.started = total, 0, time.monotonic()
        self.enabled = enabled and stderr_is_terminal()
        self.lock = threading.Lock()
        self.bar: Any = None

    def advance(self, n: int) -> None:
        """Count `n` more bytes; open the bar when it is due."""
        with self.lock:
            self.done += n
            if self.bar is None and self.enabled and time.monotonic() - self.started > PROGRESS_AFTER_S:
                self.bar = open_bar(self.total)
            if self.bar is not None:
                self.bar.update(self.bar.task_ids[0], completed=self.done)

    def __enter__(self) -> _Meter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal (where a progress bar is wanted)."""
    return sys.stderr.isatty()


def open_bar(total: int) -> Any:
    """A started rich Progress on stderr with one task of `total` bytes (the columns of
    core.convert.progress, which this layer may not import, with bytes and speed)."""
    import rich.console
    import rich.progress as rp

    bar = rp.Progress(rp.TextColumn("[bold]{task.description}"), rp.BarColumn(), rp.DownloadColumn(),
                      rp.TransferSpeedColumn(), rp.TimeElapsedColumn(), console=rich.console.Console(stderr=True))
    bar.add_task("hashing source files", total=total)
    bar.start()
    return bar


def index_path() -> Path:
    """Where the remembered digests are: digests/index.json in the cache."""
    return cache_dir() / "digests" / "index.json"


def load_index() -> dict[str, tuple[FileStamp, str]]:
    """The remembered (stamp, sha256) by real path; {} for a missing, unreadable, malformed or foreign
    index, and without its malformed entries."""
    data = _read(index_path())
    if data is None or data.get("format") != INDEX_FORMAT or data.get("version") != INDEX_VERSION:
        return {}
    files = data.get("files")
    if not isinstance(files, dict):
        return {}
    entries = {path: _index_entry(path, value) for path, value in files.items()}
    return {path: entry for path, entry in entries.items() if entry is not None}


def _index_entry(path: str, value: object) -> tuple[FileStamp, str] | None:
    """[dev, ino, size, mtime_ns, ctime_ns, sha256 hex] as (stamp, digest), or None when malformed."""
    if not isinstance(value, list) or len(value) != 6:
        return None
    *ints, digest = value
    if not all(type(i) is int for i in ints) or not _is_sha256(digest):
        return None
    return FileStamp(path, *ints), digest


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def save_index(new: dict[str, tuple[FileStamp, str]]) -> None:
    """Merge `new` into the index as it is on disk now (another process may have written it), keep
    the entries whose file still has the stamp recorded, and replace the index atomically. A cache
    that cannot be written is no error: the files are hashed again next time."""
    kept = {p: e for p, e in {**load_index(), **new}.items() if _unchanged(e[0])}
    data = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "algorithm": "sha256",
            "files": {p: [*stamp.fields(), digest] for p, (stamp, digest) in sorted(kept.items())}}
    try:
        _write_atomically(index_path(), json.dumps(data) + "\n")
    except OSError:
        pass


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path` and rename it over `path` (removing the temp on any
    failure, and temps a killed writer left more than TEMP_MAX_AGE_S ago)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f".{path.name}.tmp-*"):
        try:
            if time.time() - old.stat().st_mtime > TEMP_MAX_AGE_S:
                old.unlink()
        except OSError:
            pass
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def record_entry(key: str, source: Path, dtype: str) -> None:
    """Remove the entries of earlier states of the same source and dtype, and write engines/KEY.json
    unless it names another source that still exists (a copy of the same files, converted first).
    Called on every use of an entry: a source rewritten into a copy of another leaves no orphan."""
    engines = cache_dir() / "engines"
    me = {"source": str(Path(source).absolute()), "dtype": dtype}
    for sidecar in engines.glob("*.json"):
        if sidecar.stem != key and _read(sidecar) == me:
            remove_entry(sidecar.stem)
    mine = engines / f"{key}.json"
    recorded = _read(mine)
    if recorded == me or (recorded is not None and Path(str(recorded.get("source"))).exists()):
        return
    try:
        mine.write_text(json.dumps(me) + "\n")
    except OSError:
        pass  # a record for `cache list` and this clean-up; the entry itself is whole without it


def remove_entry(key: str) -> None:
    """Remove engines/KEY, checkpoints/KEY and engines/KEY.json, each only when it is bestiary's (`owned_entry`)."""
    for kind in ("engines", "checkpoints"):
        _remove_owned(kind, cache_dir() / kind / key)
    _remove_owned("engines", cache_dir() / "engines" / f"{key}.json")


def _read(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when it is unreadable, malformed or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class CacheEntry:
    """One thing in the cache: kind (ENTRY_KINDS), name, where it came from, its bytes (each file once, its
    hard links inside the entry too), and `shared`: those of its bytes in files hard-linked to an entry listed
    before it (build hard-links an engine's weights to its checkpoint's), already counted there."""

    kind: str
    name: str
    source: str
    path: Path
    size: int
    shared: int = 0


Inode = tuple[int, int]  # (st_dev, st_ino): one file, whatever its hard links' names


def _files(path: Path) -> dict[Inode, int]:
    """The regular files of `path` (itself, or every one under it; symlinks not followed): {inode: bytes}."""
    candidates = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    files: dict[Inode, int] = {}
    for p in candidates:
        try:
            st = p.lstat()
        except OSError:  # removed meanwhile
            continue
        if stat.S_ISREG(st.st_mode):
            files[(st.st_dev, st.st_ino)] = st.st_size
    return files


def _size(path: Path, seen: set[Inode] | None = None) -> int:
    """Bytes of `path`'s files, each inode once; with `seen`, only inodes not in it, which it then holds."""
    files = _files(path)
    new = files.keys() - seen if seen is not None else files.keys()
    if seen is not None:
        seen.update(files)
    return sum(files[i] for i in new)


def cache_total(entries: list[CacheEntry]) -> int:
    """Bytes the entries take on disk: a file hard-linked into several entries counts once."""
    return sum(e.size - e.shared for e in entries)


def cache_entries() -> list[CacheEntry]:
    """Everything under the cache's known folders; a file hard-linked into several entries is `shared` in
    every one after the first (cache_total counts it once)."""
    entries = []
    seen: set[Inode] = set()
    for kind in ENTRY_KINDS:
        folder = cache_dir() / kind
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if kind == "engines" and path.suffix == ".json":
                continue
            info = _read(cache_dir() / "engines" / f"{path.name}.json") if kind in ("engines", "checkpoints") else None
            source = f"{info['source']} ({info['dtype']})" if isinstance(info, dict) and "source" in info else ""
            files = _files(path)
            shared = sum(size for inode, size in files.items() if inode in seen)
            seen.update(files)
            entries.append(CacheEntry(kind, path.name, source, path, sum(files.values()), shared))
    return entries


# What `bestiary cache clear` may delete, folder by folder: what bestiary put there, recognised by its own
# files (core.format.output_dir's rule), never anything else $BESTIARY_CACHE holds, whatever its name.
CACHE_OUTPUTS = {"engines": ("engine",), "checkpoints": ("checkpoint",), "demo": ("checkpoint", "engine")}
KERNEL_FILES = re.compile(r"^(libbestiary_cpu_\w+\.so|tmp\w+\.so)$")  # core.kernels.cpu.build (its mkstemp temps)
DENSE_HF_FILES = re.compile(r"^(config\.json|model\.safetensors|tokenizer\.json|tokenizer_config\.json)$")  # bench


def _only(path: Path, names: re.Pattern[str]) -> bool:
    """A real directory holding only regular files named by `names`."""
    try:
        children = list(path.iterdir())
    except OSError:
        return False
    return all(c.is_file() and not c.is_symlink() and names.match(c.name) for c in children)


def owned_entry(kind: str, path: Path) -> bool:
    """Whether `path`, in the cache folder `kind`, is what bestiary put there (what `cache clear` may delete)."""
    if path.is_symlink():
        return False
    if path.is_dir() and stale(our_temp(path)):
        return True
    if kind in CACHE_OUTPUTS:
        if path.is_file():  # engines/KEY.json: the record of an entry's source
            data = _read(path) if kind == "engines" and path.suffix == ".json" else None
            return data is not None and set(data) == {"source", "dtype"}
        return output_kind(path) in CACHE_OUTPUTS[kind]
    if kind == "cpu-kernels":
        return path.is_dir() and _only(path, KERNEL_FILES)
    if kind == "dense-hf":
        return path.is_dir() and _only(path, DENSE_HF_FILES)
    if kind == "digests":
        data = _read(path) if path.name == "index.json" else None
        return (data is not None and data.get("format") == INDEX_FORMAT) or (
            path.is_file() and path.name.startswith(".index.json.tmp-"))
    return False


def _remove_owned(kind: str, path: Path, seen: set[Inode] | None = None) -> int:
    """Delete `path` when `owned_entry` says it is bestiary's; the bytes freed (files whose inode is in
    `seen`, removed before under another name, not again; `seen` then holds this entry's); without
    `seen`, all of its files."""
    if not owned_entry(kind, path):
        return 0
    size = _size(path, seen)
    try:
        if path.is_dir():
            delete_dir(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        return 0
    return 0 if os.path.lexists(path) else size


def clear_cache() -> int:
    """Remove what bestiary put in the cache's known folders (`owned_entry`), and each folder left empty;
    nothing else under $BESTIARY_CACHE. Returns the bytes freed."""
    freed = 0
    seen: set[Inode] = set()  # a file hard-linked into two entries is freed once
    for kind in ENTRY_KINDS:
        folder = cache_dir() / kind
        if folder.is_symlink() or not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            freed += _remove_owned(kind, path, seen)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
    return freed
