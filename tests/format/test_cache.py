"""Nothing stale: LLM(source) re-converts when any source file's content changes, whatever its times say;
`bestiary cache list|clear`."""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.format import cache as cache_module  # noqa: E402
from bestiary.core.format.cache import cache_dir, cache_entries, source_key  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.runtime.llm import LLM, ensure_engine  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.core.sources import source_files  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BESTIARY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _overwrite_in_place(target, replacement) -> None:
    """Rewrite `target`'s bytes in the same inode: the directory's mtime does not change."""
    stat = os.stat(target.parent)
    with open(target, "r+b") as f:
        f.write(replacement.read_bytes())
        f.truncate()
    os.utime(target.parent, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_weights_overwritten_in_place_are_converted_again(tmp_path, cache):
    """The key used the directory's mtime: the second LLM(dir) served the old model."""
    src = make_tiny_llama(tmp_path / "a", seed=0)
    other = make_tiny_llama(tmp_path / "b", seed=1)
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    first = LLM(src).generate([[1, 2, 3]], greedy)[0].output_ids
    expected = LLM(other).generate([[1, 2, 3]], greedy)[0].output_ids
    assert first != expected
    _overwrite_in_place(src / "model.safetensors", other / "model.safetensors")
    assert LLM(src).generate([[1, 2, 3]], greedy)[0].output_ids == expected
    engines = [e for e in cache_entries() if e.kind == "engines"]
    # src now holds other's files: they share other's entry (the key is the content), and src's old
    # state was removed
    assert len(engines) == 1, engines
    assert engines[0].source.split(" ")[0] == str(other.absolute())


def _rewrite_keeping_times(path, data: bytes) -> None:
    """Issue 46's rewrite: same size, same inode, atime and mtime put back with os.utime."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_same_size_rewrite_with_mtime_restored_converts_again(tmp_path, cache, monkeypatch, name):
    """Issue 46 item 1: the key was (path, size, mtime_ns); the rewrite served the old conversion
    (cum_log_prob -78.18 from the cache, -80.63 fresh). RACY_NS 0: the digests are remembered."""
    monkeypatch.setattr(cache_module, "RACY_NS", 0)
    src = make_tiny_llama(tmp_path / "a", seed=0)
    fresh = make_tiny_llama(tmp_path / "b", seed=0 if name == "config.json" else 1)
    config = (src / "config.json").read_text()
    edited = config.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 9e-01')
    assert edited != config
    (fresh / "config.json").write_text(edited if name == "config.json" else config)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0, output_log_probs=True)
    old = LLM(src).generate([[1, 2, 3]], sampling)[0].cum_log_prob
    expected = LLM(fresh).generate([[1, 2, 3]], sampling)[0].cum_log_prob
    assert old != expected
    data = edited.encode() if name == "config.json" else (fresh / name).read_bytes()
    _rewrite_keeping_times(src / name, data)
    assert LLM(src).generate([[1, 2, 3]], sampling)[0].cum_log_prob == expected


def test_a_warm_start_reads_no_source_bytes(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(cache_module, "RACY_NS", 0)
    src = make_tiny_llama(tmp_path)
    engine = ensure_engine(src)
    read: list[str] = []
    monkeypatch.setattr(cache_module, "file_sha256", lambda path, meter, stop: read.append(path) or "")
    assert ensure_engine(src) == engine and read == []


def test_a_source_written_while_converting_leaves_no_entry(tmp_path, cache, monkeypatch):
    from bestiary.core.convert import source_to_checkpoint

    src = make_tiny_llama(tmp_path)
    real = source_to_checkpoint.convert

    def convert_while_written(*args, **kwargs):
        out = real(*args, **kwargs)
        (src / "config.json").write_text((src / "config.json").read_text())  # same bytes, a new ctime
        return out

    monkeypatch.setattr(source_to_checkpoint, "convert", convert_while_written)
    with pytest.raises(BestiaryError, match="its files changed while it was converted; run again"):
        ensure_engine(src)
    assert [e for e in cache_entries() if e.kind in ("engines", "checkpoints")] == []
    monkeypatch.setattr(source_to_checkpoint, "convert", real)
    assert (ensure_engine(src) / "config.json").is_file()


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json"])
def test_any_source_file_is_in_the_key(tmp_path, cache, name):
    src = make_tiny_llama(tmp_path)
    (src / "tokenizer.json").write_text("{}")
    before = source_key(src, source_files(src), "auto")
    path = src / name
    data = path.read_bytes()
    path.write_bytes(data + b" ")
    assert source_key(src, source_files(src), "auto") != before
    assert source_key(src, source_files(src), "float32") != source_key(src, source_files(src), "auto")


def test_an_engine_dir_without_rank0_is_not_taken_for_a_source(tmp_path, cache, capsys):
    """It said 'no weight files found' (taken for an HF source)."""
    src = make_tiny_llama(tmp_path)
    assert main(["convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "ckpt")]) == 0
    assert main(["build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "eng")]) == 0
    (tmp_path / "eng" / "rank0.safetensors").unlink()
    capsys.readouterr()
    assert main(["run", "--engine_dir", str(tmp_path / "eng"), "--input_ids", "1"]) == 2
    err = capsys.readouterr().err
    assert "rank0.safetensors: rank file not found" in err and "no weight files" not in err
    assert not cache.exists()


def test_cache_list_and_clear(tmp_path, cache, capsys, monkeypatch):
    src = make_tiny_llama(tmp_path)
    LLM(src)
    keep = cache / "unrelated.txt"  # $BESTIARY_CACHE may hold other things: clear leaves them
    keep.write_text("x")
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert str(cache) in out and "engines" in out and "checkpoints" in out and str(src.absolute()) in out
    assert main(["cache", "clear"]) == 0
    assert "MiB freed" in capsys.readouterr().err
    assert sorted(p.name for p in cache.iterdir()) == ["unrelated.txt"]
    assert cache_entries() == []


def test_default_location(monkeypatch, tmp_path):
    monkeypatch.delenv("BESTIARY_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "bestiary"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "bestiary"


def test_engine_sidecar_is_not_in_the_engine_dir(tmp_path, cache):
    src = make_tiny_llama(tmp_path)
    engine = ensure_engine(src)
    assert sorted(p.name for p in engine.iterdir()) == ["config.json", "rank0.safetensors"]
    assert json.loads((engine.parent / f"{engine.name}.json").read_text())["source"] == str(src.absolute())
    shutil.rmtree(cache)
