"""A warm `bestiary demo` starts from the engine it built before (core.cli.demo.make_demo_engine): convert and
build run again only when the GGUF's contents, the dtype or the build limits changed, or the engine is not whole.
Convert and build are counted stand-ins here; test_smollm2.py runs the real demo (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from bestiary.core.cli import demo
from bestiary.core.convert import checkpoint_to_engine, source_to_checkpoint


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """convert / build_engine replaced by stand-ins that write a whole directory and log their calls."""
    log: list[str] = []

    def convert(source, out: Path, options, show_progress=False) -> Path:
        log.append(f"convert {options.dtype}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        return out

    def build_engine(ckpt: Path, out: Path, config) -> Path:
        log.append("build")
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"from": str(ckpt)}))
        return out

    monkeypatch.setattr(source_to_checkpoint, "convert", convert)
    monkeypatch.setattr(checkpoint_to_engine, "build_engine", build_engine)
    return log


def test_a_warm_demo_reuses_its_engine(tmp_path, calls, monkeypatch) -> None:
    gguf, base, err = tmp_path / "model.gguf", tmp_path / "demo", Console(quiet=True)
    gguf.write_bytes(b"GGUF one")
    engine = demo.make_demo_engine(gguf, base, "float32", err)
    assert calls == ["convert float32", "build"] and (engine / "config.json").is_file()
    assert demo.make_demo_engine(gguf, base, "float32", err) == engine and calls == ["convert float32", "build"]
    demo.make_demo_engine(gguf, base, "bfloat16", err)  # another dtype: its own engine
    assert calls[2:] == ["convert bfloat16", "build"]
    gguf.write_bytes(b"GGUF two")  # new contents: the record's sha256 no longer matches
    demo.make_demo_engine(gguf, base, "float32", err)
    assert calls[4:] == ["convert float32", "build"]
    (engine / "config.json").unlink()  # an interrupted build: not whole
    demo.make_demo_engine(gguf, base, "float32", err)
    assert calls[6:] == ["convert float32", "build"]
    monkeypatch.setattr(demo, "DEMO_BUILD", {**demo.DEMO_BUILD, "max_seq_len": 1024})  # other limits
    demo.make_demo_engine(gguf, base, "float32", err)
    assert calls[8:] == ["convert float32", "build"]
