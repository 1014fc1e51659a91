"""The tree shows the data flow: import rules between core's stage packages, parsed from the source.

The rules are the ones each package's `__init__.py` docstring states. A module's imports are
every `import` / `from ... import` in its source (at module level or inside functions).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Imports from the public API that architecture plugins may use (docs/add-an-architecture.md).
PLUGIN_API = (
    "bestiary.core.layers", "bestiary.core.runtime.model", "bestiary.core.format",
    "bestiary.core.convert.loader", "bestiary.core.convert.postprocess",
    "bestiary.plugins", "bestiary.registry",
)

# package -> what its modules may not import (prefixes), and the documented exceptions.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "bestiary.core.format": ("bestiary.core.", "bestiary.models", "bestiary.registry", "bestiary.plugins"),
    "bestiary.core.sources": ("bestiary.core.convert", "bestiary.core.runtime", "bestiary.core.cli",
                              "bestiary.core.quant", "bestiary.core.layers", "bestiary.models"),
    "bestiary.core.convert": ("bestiary.core.cli",),
    "bestiary.core.runtime": ("bestiary.core.convert", "bestiary.core.cli", "bestiary.core.serve"),
    "bestiary.core.serve": ("bestiary.core.convert", "bestiary.core.cli"),
    "bestiary.core.bench": ("bestiary.core.convert", "bestiary.core.cli", "bestiary.core.serve"),
    "bestiary.core.layers": ("bestiary.core.convert", "bestiary.core.cli", "bestiary.models"),
    "bestiary.core.kernels": ("bestiary.core.convert", "bestiary.core.cli", "bestiary.models"),
    "bestiary.core.cpu": ("bestiary.core.convert", "bestiary.core.cli", "bestiary.models"),
    "bestiary.core.lora": ("bestiary.core.convert", "bestiary.core.runtime", "bestiary.core.cli", "bestiary.models"),
    "bestiary.core.quant": ("bestiary.core.cli", "bestiary.models"),
    "bestiary.registry": ("bestiary.core.convert", "bestiary.core.runtime", "bestiary.core.cli"),
    "bestiary.plugins": ("bestiary.core.convert", "bestiary.core.runtime", "bestiary.core.cli"),
}
# package -> modules it may import although a prefix above forbids them.
EXCEPT: dict[str, tuple[str, ...]] = {
    # packed int8/int4 codes are a data format: sources (.flm, GGUF) land them in bestiary's layouts
    "bestiary.core.sources": ("bestiary.core.quant.packing",),
}
# (importing module, imported module): the one documented edge, LLM(source) converting on the fly.
ALLOWED_EDGES = {
    ("bestiary.core.runtime.llm", "bestiary.core.convert.checkpoint_to_engine"),
    ("bestiary.core.runtime.llm", "bestiary.core.convert.source_to_checkpoint"),
}
# Inside format, only format itself.
FORMAT_OWN = "bestiary.core.format"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("bestiary", *parts))


@functools.cache
def import_statements(source: str, me: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(module, names) of each import statement in `source`; relative modules resolved from `me`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = me.rsplit(".", node.level)[0]
                base = f"{anchor}.{base}" if base else anchor
            found.append((base, tuple(a.name for a in node.names)))
    return tuple(found)


def imports_of(source: str, me: str, known: set[str]) -> set[str]:
    """Every bestiary module an import statement in `source` names.

    `from pkg import name` counts as `pkg.name` when that is a module in `known`, else as `pkg`.
    """
    found: set[str] = set()
    for base, names in import_statements(source, me):
        found.update(f"{base}.{n}" if f"{base}.{n}" in known else base for n in names or ("",))
    return {m for m in found if m == "bestiary" or m.startswith("bestiary.")}


def violations(files: dict[str, str]) -> list[str]:
    """`module -> source` in, one line per import that breaks the rules out."""
    bad = []
    for me, source in sorted(files.items()):
        for target in sorted(imports_of(source, me, set(files))):
            if (me, target) in ALLOWED_EDGES:
                continue
            if me.startswith("bestiary.models."):
                own = ".".join(me.split(".")[:3])
                ok = target.startswith(own) or any(target == p or target.startswith(p + ".") for p in PLUGIN_API)
                if target.startswith("bestiary.core") and not ok:
                    bad.append(f"{me} imports {target} (models import only the plugin API)")
                continue
            for package, forbidden in FORBIDDEN.items():
                if not (me == package or me.startswith(package + ".")):
                    continue
                if package == FORMAT_OWN and target.startswith(FORMAT_OWN):
                    continue
                if target in EXCEPT.get(package, ()):
                    continue
                if any(target.startswith(f) if f.endswith(".") else target == f or target.startswith(f + ".")
                       for f in forbidden):
                    bad.append(f"{me} imports {target} ({package} may not)")
    return bad


def tree_sources() -> dict[str, str]:
    out = {}
    for folder in ("core", "models", "registry", "plugins"):
        for path in (ROOT / folder).rglob("*.py"):
            out[module_name(path)] = path.read_text()
    return out


def test_tree_follows_the_import_rules():
    assert violations(tree_sources()) == []


@pytest.mark.parametrize(("module", "line"), [
    ("bestiary.core.runtime.executor", "from bestiary.core.convert.loader import translate"),
    ("bestiary.core.runtime.kv_cache", "import bestiary.core.cli.main"),
    ("bestiary.core.format.config", "from bestiary.core.runtime.model import DecoderLM"),
    ("bestiary.core.format.errors", "from bestiary.registry import Registry"),
    ("bestiary.core.layers.mlp", "from bestiary.core.convert import convert"),
    ("bestiary.core.sources.base", "from bestiary.core.quant.slot import WeightOnlySlot"),
    ("bestiary.models.llama.model", "from bestiary.core.runtime.executor import Executor"),
    ("bestiary.models.opt.model", "from bestiary.core.quant.modes import QuantMode"),
    ("bestiary.core.runtime.engine", "from ..convert import source_to_checkpoint"),
])
def test_a_planted_violation_is_reported(module, line):
    files = tree_sources()
    files[module] = files[module] + "\n" + line + "\n"
    found = violations(files)
    assert len(found) == 1 and found[0].startswith(f"{module} imports"), found


def test_the_documented_edge_is_the_only_one():
    files = tree_sources()
    llm = files["bestiary.core.runtime.llm"]
    assert "from bestiary.core.convert.source_to_checkpoint import convert" in llm
    files["bestiary.core.runtime.engine"] += "\nfrom bestiary.core.convert.source_to_checkpoint import convert\n"
    assert len(violations(files)) == 1


def test_every_core_module_lives_in_a_stage_package():
    loose = sorted(p.name for p in (ROOT / "core").glob("*.py") if p.name != "__init__.py")
    assert loose == []


@pytest.mark.parametrize("old", sorted(importlib.import_module("bestiary.core").MOVED))
def test_old_module_paths_are_the_moved_modules(old):
    moved = importlib.import_module("bestiary.core").MOVED
    assert importlib.import_module(old) is importlib.import_module(moved[old])


def test_old_convert_and_cli_imports_work():
    from bestiary.core.cli import main
    from bestiary.core.convert import convert, instantiate, rank_writer
    from bestiary.core.convert.source_to_checkpoint import convert as moved

    assert convert is moved and callable(instantiate) and callable(rank_writer) and callable(main)


def test_calibration_text_is_package_data_and_byte_identical():
    """The text moved out of calib_text.py unchanged (the quantization gates must not move)."""
    from bestiary.core.quant.calib_text import WEIGHT_CALIB_TEXT
    from bestiary.core.quant.calibrate import BUILTIN_TEXT

    assert hashlib.sha256(WEIGHT_CALIB_TEXT.encode()).hexdigest() == (
        "3ee5c6b90296727a6d40731476b213515ec4d76185b797b9acc42515188d10c7")
    assert hashlib.sha256(BUILTIN_TEXT.encode()).hexdigest() == (
        "0424354b455b5e537e45264c274de5a79d7a6b0b4ba89c11c858da16ca56b22c")
    assert len((ROOT / "core" / "quant" / "calib_text.py").read_text().splitlines()) < 60
