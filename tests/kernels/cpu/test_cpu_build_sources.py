"""The sources of the compiled CPU kernels (core.kernels.cpu.build): kernels.c is one translation unit that
#includes a part per op family; every part is hashed into the build's cache key and shipped as package data."""

from __future__ import annotations

import fnmatch
import re
import shutil
import sys
from pathlib import Path

import tomllib

from bestiary.core.kernels.cpu import build

ROOT = Path(__file__).resolve().parents[3]


def quoted_includes(path: Path) -> set[str]:
    """The files `path` #includes with quotes ("x.h"), by name."""
    return set(re.findall(r'^#include "([^"]+)"', path.read_text(), re.M))


def test_kernels_c_includes_every_part_and_only_parts():
    """Each .c / .h beside kernels.c is #included (by kernels.c), and nothing quoted comes from elsewhere:
    the cache key (every .c and .h there) then covers exactly what the compiler reads."""
    names = {p.name for p in build.sources()}
    assert "kernels.c" in names and {"common.h", "vector.h", "plan.c"} <= names
    included = quoted_includes(build.SOURCE)
    assert included == names - {"kernels.c"}
    for part in build.sources():
        assert quoted_includes(part) <= names, part.name


def test_a_change_in_any_part_changes_the_cache_key(tmp_path, monkeypatch):
    """Bug guard: the key hashed kernels.c alone; with the ops split into parts, an edit to a part must rebuild."""
    for part in build.sources():
        shutil.copy(part, tmp_path / part.name)
    monkeypatch.setattr(build, "SOURCE", tmp_path / "kernels.c")
    cc = sys.executable  # _key reads `cc --version`: any program that answers it
    base = build._key(cc, "scalar")
    assert build._key(cc, "scalar") == base and build._key(cc, "avx2") != base
    for name in ("lora.c", "vector.h", "kernels.c"):
        path = tmp_path / name
        text = path.read_text()
        path.write_text(text + "/* edited */\n")
        assert build._key(cc, "scalar") != base, name
        path.write_text(text)
    assert build._key(cc, "scalar") == base


def test_package_data_ships_every_source():
    """pyproject's package data for bestiary.core.kernels.cpu matches each file a build reads."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["bestiary.core.kernels.cpu"]
    for part in build.sources():
        assert any(fnmatch.fnmatch(part.name, pattern) for pattern in patterns), part.name
