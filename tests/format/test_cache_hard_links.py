"""`bestiary cache list|clear` count a file hard-linked into several entries once: build hard-links an
engine's weights to its checkpoint's, and the demo's 514.6 MiB checkpoint + 514.6 MiB engine took 517 MiB
on disk, not the 1029 MiB the listing's total said."""

from __future__ import annotations

import json
import os

import pytest

from bestiary.core.cli.main import main
from bestiary.core.format.cache import cache_entries, cache_total, clear_cache

MIB = 2**20


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache holding the demo's checkpoint (3 MiB of weights + a 1 MiB tokenizer) and its engine, whose
    weights are a hard link to the checkpoint's and whose tokenizer is a copy."""
    root = tmp_path / "cache"
    ckpt, engine = root / "demo" / "tiny-ckpt", root / "demo" / "tiny-engine"
    ckpt.mkdir(parents=True)
    engine.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM", "mapping": {}}))
    (engine / "config.json").write_text(json.dumps({"format_version": 1, "pretrained_config": {}, "build_config": {}}))
    (ckpt / "rank0.safetensors").write_bytes(b"\0" * (3 * MIB))
    os.link(ckpt / "rank0.safetensors", engine / "rank0.safetensors")
    for d in (ckpt, engine):
        (d / "tokenizer.json").write_bytes(b"\1" * MIB)
    monkeypatch.setenv("BESTIARY_CACHE", str(root))
    monkeypatch.setenv("COLUMNS", "200")
    return root


def config_bytes(cache, name: str) -> int:
    return (cache / "demo" / name / "config.json").stat().st_size


def test_entries_count_a_hard_linked_file_once(cache):
    ckpt, engine = cache_entries()
    assert (ckpt.name, engine.name) == ("tiny-ckpt", "tiny-engine")
    assert ckpt.size == 4 * MIB + config_bytes(cache, "tiny-ckpt") and ckpt.shared == 0
    assert engine.size == 4 * MIB + config_bytes(cache, "tiny-engine") and engine.shared == 3 * MIB
    on_disk = 5 * MIB + config_bytes(cache, "tiny-ckpt") + config_bytes(cache, "tiny-engine")
    assert cache_total([ckpt, engine]) == on_disk


def test_links_inside_one_entry_count_once(cache):
    ckpt = cache / "demo" / "tiny-ckpt"
    os.link(ckpt / "rank0.safetensors", ckpt / "rank1.safetensors")
    entry = cache_entries()[0]
    assert entry.size == 4 * MIB + config_bytes(cache, "tiny-ckpt") and entry.shared == 0


def test_cache_list_says_what_is_shared_and_the_total_on_disk(cache, capsys):
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[2].strip(): [c.strip() for c in line.split("│")[4:6]] for line in out.splitlines()
            if line.count("│") >= 6}
    assert rows["tiny-ckpt"] == ["4.0", ""] and rows["tiny-engine"] == ["4.0", "3.0"]
    assert rows[""] == ["5.0", ""]  # the total row: on disk, the shared 3 MiB once
    assert "total on disk" in out and "hard links" in out and "counted once" in out


def test_clear_frees_a_hard_linked_file_once(cache):
    on_disk = cache_total(cache_entries())
    assert clear_cache() == on_disk
    assert cache_entries() == []


def test_no_shared_column_without_hard_links(cache, capsys):
    os.unlink(cache / "demo" / "tiny-engine" / "rank0.safetensors")
    (cache / "demo" / "tiny-engine" / "rank0.safetensors").write_bytes(b"\0" * (3 * MIB))
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "shared MiB" not in out and "hard links" not in out and "total on disk" in out
