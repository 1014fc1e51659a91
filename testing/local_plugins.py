"""The registry of a plugin package that is not pip-installed, read from its own directory.

`local_registry(path)` finds the nearest pyproject.toml at or above `path`, reads its
`[project.entry-points."bestiary.architectures"]` table, imports each named module with the
package directory on sys.path (so the spec's "module:attr" references resolve exactly as
after `pip install`), and returns the installed plugins plus these. Entry points that are
installed already (the same module) are not loaded twice. The package under test wins: an
architecture it registers replaces an installed one of the same name (a third-party Qwen2
plugin is checked as itself, not as the built-in Qwen2), in this registry only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path

from bestiary.core.format.errors import BestiaryError
from bestiary.plugins.hookspecs import ENTRY_POINT_GROUP
from bestiary.registry import Registry


def find_pyproject(path: str | Path) -> Path | None:
    """The nearest pyproject.toml at or above `path` (a file or a directory)."""
    here = Path(path).resolve()
    for folder in [here, *here.parents] if here.is_dir() else here.parents:
        if (folder / "pyproject.toml").is_file():
            return folder / "pyproject.toml"
    return None


def declared_entry_points(pyproject: Path) -> dict[str, str]:
    """name -> module of the `bestiary.architectures` entry points a pyproject.toml declares."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: tomli, which pytest itself requires there (mypy on 3.11+ may not find it)
        import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

    data = tomllib.loads(pyproject.read_text())
    return dict(data.get("project", {}).get("entry-points", {}).get(ENTRY_POINT_GROUP, {}))


def local_registry(path: str | Path) -> Registry:
    """Installed plugins + the plugins declared by the package around `path` (not installed ones only)."""
    pyproject = find_pyproject(path)
    if pyproject is None:
        raise BestiaryError(f"{path}: no pyproject.toml at or above it")
    installed = {ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    wanted = {n: m for n, m in declared_entry_points(pyproject).items() if m not in installed}
    root = str(pyproject.parent)
    if wanted and root not in sys.path:
        sys.path.insert(0, root)
    local: dict[str, object] = {f"{name} (local)": importlib.import_module(module) for name, module in wanted.items()}
    return Registry.from_plugins(local, override=True)
