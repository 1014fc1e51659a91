"""docs/add-an-architecture.md shows its two example plugins file by file; the files are the plugins of
tests/data that the suite runs (test_third_party_qwen2.py, test_third_party_plugin.py). A built-in
family is written the same way, so what the docs teach is what runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "add-an-architecture.md"
# doc section -> the plugin directory its file blocks are
PLUGINS = {"## Quick start": ROOT / "tests" / "data" / "qwen2_plugin",
           "## Worked example: TinyGPT": ROOT / "tests" / "data" / "tinygpt_plugin"}
# "`path`: what it holds ..." (one or more lines), a blank line, then the file's code block
NAMED_BLOCK = re.compile(r"^(?:### )?`(?P<path>[\w./-]+\.(?:py|toml))`[^\n]*(?:\n[^\n]+)*\n\n```\w+\n(?P<body>.*?)```",
                         re.M | re.S)


def doc_files() -> list[tuple[Path, str]]:
    """(plugin file, the block the doc shows for it) for every file block of the two example sections."""
    text = DOC.read_text()
    out = []
    for heading, plugin in PLUGINS.items():
        start = text.index(heading)
        end = text.find("\n## ", start + len(heading))
        out += [(plugin / m["path"], m["body"]) for m in NAMED_BLOCK.finditer(text[start:end])]
    return out


def test_the_doc_shows_every_file_of_both_plugins():
    shown = {path for path, _ in doc_files()}
    present = {p for plugin in PLUGINS.values() for p in plugin.rglob("*") if p.suffix in (".py", ".toml")}
    assert shown == present, f"shown only: {sorted(shown - present)}; in tests/data only: {sorted(present - shown)}"


@pytest.mark.parametrize("path,body", doc_files(), ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else "")
def test_a_doc_block_is_the_plugin_file(path, body):
    assert body == path.read_text(), f"docs/add-an-architecture.md's {path.name} differs from {path.relative_to(ROOT)}"
