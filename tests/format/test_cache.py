"""Nothing stale: LLM(source) re-converts when any source file changes; `bestiary cache list|clear`."""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.format.cache import cache_dir, cache_entries, source_key  # noqa: E402
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
    assert len(engines) == 2, engines  # src's old state was replaced, `other` has its own
    assert {e.source.split(" ")[0] for e in engines} == {str(src.absolute()), str(other.absolute())}


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
