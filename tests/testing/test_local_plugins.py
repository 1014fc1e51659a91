"""bestiary.testing.local_plugins on every supported Python (requires-python >= 3.10)."""

from __future__ import annotations

import importlib
import sys

from bestiary.testing.local_plugins import declared_entry_points

PYPROJECT = """
[project]
name = "bestiary-tiny"

[project.entry-points."bestiary.architectures"]
tiny = "bestiary_tiny.plugin"
"""


def test_entry_points_read_on_python_3_10_through_tomli(tmp_path, monkeypatch):
    """Python 3.10 has no tomllib: the kit reads pyproject.toml with tomli there (pytest's own dependency)."""
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    toml = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` fails, as on 3.10
    monkeypatch.setitem(sys.modules, "tomli", toml)  # the same API
    assert declared_entry_points(tmp_path / "pyproject.toml") == {"tiny": "bestiary_tiny.plugin"}
