"""The cache key from content (core.format.cache): digests remembered by stamp, never by times alone.

Each test is a way a stale or broken index could serve the wrong key, or crash, or read bytes a
warm start does not need to read."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bestiary.core.format import cache
from bestiary.core.format.cache import file_digests, index_path, load_index, source_key
from bestiary.core.format.errors import BestiaryError


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """An empty cache; RACY_NS 0 so that files written by the test itself are remembered."""
    monkeypatch.setenv("BESTIARY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "RACY_NS", 0)
    return tmp_path / "cache"


@pytest.fixture
def src(tmp_path) -> Path:
    """A source dir of three small files."""
    d = tmp_path / "src"
    d.mkdir()
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (d / "config.json").write_text('{"rms_norm_eps": 1e-06}')
    (d / "tokenizer.json").write_text("{}")
    return d


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file())


@pytest.fixture
def hashes(monkeypatch) -> list[str]:
    """The paths file_sha256 is called on (each call reads a whole file)."""
    calls: list[str] = []
    real = cache.file_sha256

    def counting(path, meter, stop):
        calls.append(Path(path).name)
        return real(path, meter, stop)

    monkeypatch.setattr(cache, "file_sha256", counting)
    return calls


def _rewrite_keeping_times(path: Path, data: bytes) -> None:
    """The issue's rewrite: same size, same inode, atime and mtime put back with os.utime."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_size == st.st_size


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_same_size_rewrite_with_mtime_restored_changes_the_key(src, cache_home, hashes, name):
    """Issue 46 item 1: the key was (path, size, mtime_ns), so this rewrite kept it."""
    before = source_key(src, _files(src), "auto")
    assert load_index(), "the digests were remembered"
    data = (src / name).read_bytes()
    _rewrite_keeping_times(src / name, data.replace(b"1e-06", b"9e-01") if name == "config.json" else data[::-1])
    hashes.clear()
    assert source_key(src, _files(src), "auto") != before
    assert hashes == [name]  # only the rewritten file is read again


def test_unchanged_source_reads_no_bytes(src, cache_home, hashes):
    key = source_key(src, _files(src), "auto")
    assert sorted(hashes) == ["config.json", "model.safetensors", "tokenizer.json"]
    hashes.clear()
    assert source_key(src, _files(src), "auto") == key
    assert source_key(src, _files(src), "float32") != key
    assert hashes == []


def test_touched_but_identical_file_keeps_the_key(src, cache_home, hashes):
    key = source_key(src, _files(src), "auto")
    hashes.clear()
    os.utime(src / "model.safetensors")  # mtime (and ctime) now
    assert source_key(src, _files(src), "auto") == key
    assert hashes == ["model.safetensors"]  # read once more, then remembered again
    hashes.clear()
    assert source_key(src, _files(src), "auto") == key and hashes == []


def test_copies_and_moves_share_the_key_names_do_not(src, cache_home, tmp_path):
    key = source_key(src, _files(src), "auto")
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in _files(src):
        (copy / f.name).write_bytes(f.read_bytes())
    assert source_key(copy, _files(copy), "auto") == key
    moved = src.rename(tmp_path / "moved")
    assert source_key(moved, _files(moved), "auto") == key
    (moved / "tokenizer.json").rename(moved / "tokenizer2.json")
    assert source_key(moved, _files(moved), "auto") != key
    weights = moved / "model.safetensors"
    assert source_key(weights, [weights], "auto") != source_key(moved, [weights], "auto")  # file vs dir


@pytest.mark.parametrize("data", [
    b"not json", b"[1, 2]", b'{"format": "other", "version": 1, "files": {}}',
    b'{"format": "bestiary-file-digests", "version": 99, "files": {}}',
    b'{"format": "bestiary-file-digests", "version": 1, "files": []}', b"[" * 100000, b"\xff\xfe{", b"",
])
def test_corrupt_or_foreign_index_is_ignored_and_replaced(src, cache_home, hashes, data):
    key = source_key(src, _files(src), "auto")
    index_path().write_bytes(data)
    hashes.clear()
    assert source_key(src, _files(src), "auto") == key
    assert len(hashes) == 3  # nothing trusted
    assert json.loads(index_path().read_text())["format"] == "bestiary-file-digests"
    hashes.clear()
    assert source_key(src, _files(src), "auto") == key and hashes == []


def test_malformed_entries_are_dropped_not_trusted(src, cache_home, hashes):
    key = source_key(src, _files(src), "auto")
    data = json.loads(index_path().read_text())
    files = data["files"]
    weights, config, tok = (str(Path(os.path.realpath(src / n))) for n in
                            ("model.safetensors", "config.json", "tokenizer.json"))
    files[weights][-1] = "0" * 63  # a short digest
    files[config][0] = str(files[config][0])  # a stamp field of the wrong type
    files[tok] = {"not": "a list"}
    index_path().write_text(json.dumps(data))
    hashes.clear()
    assert source_key(src, _files(src), "auto") == key
    assert sorted(hashes) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_a_file_written_just_now_is_hashed_but_not_remembered(src, cache_home, hashes, monkeypatch):
    """A second same-size write in the same clock tick would keep ctime: git's racy-clean case."""
    monkeypatch.setattr(cache, "RACY_NS", 10**18)
    key = source_key(src, _files(src), "auto")
    assert load_index() == {}
    hashes.clear()
    assert source_key(src, _files(src), "auto") == key and len(hashes) == 3


def test_index_keeps_only_files_that_still_have_their_stamp(src, cache_home, tmp_path):
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * 10)
    file_digests([other])
    source_key(src, _files(src), "auto")
    assert str(other) in load_index()
    other.unlink()
    (src / "tokenizer.json").write_text('{"a": 1}')
    source_key(src, _files(src), "auto")
    assert str(other) not in load_index() and len(load_index()) == 3


def test_index_is_replaced_atomically_and_old_temps_are_removed(src, cache_home, monkeypatch):
    source_key(src, _files(src), "auto")
    old = index_path().parent / ".index.json.tmp-killed"
    young = index_path().parent / ".index.json.tmp-writing"
    old.write_text("{")
    young.write_text("{")
    os.utime(old, (time.time() - 3600, time.time() - 3600))

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.os, "replace", fail)
    before = index_path().read_text()
    (src / "config.json").write_text("{}")
    source_key(src, _files(src), "auto")  # the write fails: no error, the old index stays whole
    assert index_path().read_text() == before
    assert sorted(p.name for p in index_path().parent.iterdir()) == [".index.json.tmp-writing", "index.json"]


def test_unreadable_file_is_one_error_naming_it(src, cache_home, monkeypatch):
    def deny(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(BestiaryError, match=r"model.safetensors: cannot read it to hash it: Permission denied"):
        source_key(src / "model.safetensors", [src / "model.safetensors"], "auto")


def test_progress_bar_only_when_hashing_is_slow_and_stderr_a_terminal(src, cache_home, monkeypatch):
    opened: list[int] = []

    class Bar:
        task_ids = [0]

        def update(self, task, completed):
            assert completed <= opened[0]

        def stop(self):
            opened.append(-1)

    monkeypatch.setattr(cache, "open_bar", lambda total: opened.append(total) or Bar())
    monkeypatch.setattr(cache, "stderr_is_terminal", lambda: True)
    file_digests(_files(src))
    assert opened == []  # far under PROGRESS_AFTER_S
    monkeypatch.setattr(cache, "PROGRESS_AFTER_S", -1.0)
    os.utime(src / "model.safetensors")
    file_digests(_files(src))
    assert opened == [(src / "model.safetensors").stat().st_size, -1]
    monkeypatch.setattr(cache, "stderr_is_terminal", lambda: False)
    os.utime(src / "model.safetensors")
    file_digests(_files(src), show_progress=True)
    assert opened == [(src / "model.safetensors").stat().st_size, -1]


def test_an_interrupt_stops_every_hashing_thread(tmp_path, cache_home, monkeypatch):
    """Ctrl-C while several files are hashed: no thread keeps reading after the interrupt is raised."""
    files = []
    for i in range(4):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(b"x" * (4 << 20))
    monkeypatch.setattr(cache, "CHUNK_BYTES", 1 << 10)
    seen: list[int] = []
    real = cache._Meter.advance

    def advance(self, n):
        seen.append(n)
        if len(seen) == 50:
            raise KeyboardInterrupt
        real(self, n)

    monkeypatch.setattr(cache._Meter, "advance", advance)
    with pytest.raises(KeyboardInterrupt):
        file_digests(files)
    assert len(seen) < 4 * (4 << 10)  # the other threads stopped within a chunk of the stop
    assert load_index() == {}


def test_a_device_is_refused_not_hashed_forever():
    """`run --engine_dir /dev/zero` hung hashing the device (fuzz seed 0 case 347)."""
    from bestiary.core.format.cache import file_stamp
    from bestiary.core.format.errors import BestiaryError

    with pytest.raises(BestiaryError, match="/dev/zero: not a regular file"):
        file_stamp("/dev/zero")
