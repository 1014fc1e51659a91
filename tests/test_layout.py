"""The layers of the core, bottom to top, and their import rules, parsed from the source.

A package may import its own modules and the packages of the layers below its own; never a
sibling of its layer, never a layer above. Every `import` counts: at module level, inside a
function, under TYPE_CHECKING. LAZY_EXCEPTIONS lists the one kind of upward edge allowed, each
inside a function and with its reason. Architecture packages (bestiary.models.*) import only the
plugin API. docs/architecture.md draws the same map; each package's docstring states its layer
and what it may import (`test_package_docstrings_state_the_rule` keeps them true).

    python tests/test_layout.py     prints the package import graph and its cycles (none)
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top; the packages of one layer are siblings: neither imports the other.
LAYERS: list[tuple[str, ...]] = [
    ("format",),
    ("plugins", "sources", "kernels"),
    ("registry", "layers"),
    ("quant", "lora"),
    ("runtime",),
    ("convert",),
    ("bench", "serve"),
    ("cli", "testing"),
]
PACKAGES = {name: (f"bestiary.{name}" if name in ("plugins", "registry", "testing") else f"bestiary.core.{name}")
            for layer in LAYERS for name in layer}
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# Imports from the public API that architecture plugins may use (docs/add-an-architecture.md).
PLUGIN_API = (
    "bestiary.core.layers", "bestiary.core.runtime.model", "bestiary.core.format",
    "bestiary.core.convert.loader", "bestiary.core.convert.postprocess",
    "bestiary.plugins", "bestiary.registry",
)

# (importing module, imported module) -> why: upward edges allowed inside a function only.
LAZY_EXCEPTIONS = {
    ("bestiary.core.runtime.llm", "bestiary.core.convert.checkpoint_to_engine"):
        "LLM(source) converts and builds a source that is not an engine dir on the fly (ensure_engine)",
    ("bestiary.core.runtime.llm", "bestiary.core.convert.source_to_checkpoint"):
        "LLM(source) converts and builds a source that is not an engine dir on the fly (ensure_engine)",
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("bestiary", *parts))


def _resolve(node: ast.ImportFrom, me: str, is_package: bool) -> str:
    base = node.module or ""
    if node.level:
        anchor = me if is_package else me.rsplit(".", 1)[0]
        anchor = anchor.rsplit(".", node.level - 1)[0] if node.level > 1 else anchor
        base = f"{anchor}.{base}" if base else anchor
    return base


@functools.cache
def import_statements(source: str, me: str, is_package: bool = False) -> tuple[tuple[str, tuple[str, ...], bool], ...]:
    """(module, names, at module level) of each import statement in `source`; relative ones resolved."""
    tree = ast.parse(source)
    top = {id(n) for n in tree.body}
    for n in tree.body:  # statements under a module-level if / try run at import time too
        if isinstance(n, (ast.If, ast.Try)) and not _is_type_checking(n):
            top |= {id(m) for m in ast.walk(n)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((a.name, (), id(node) in top) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((_resolve(node, me, is_package), tuple(a.name for a in node.names), id(node) in top))
    return tuple(found)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(source: str, me: str, known: set[str], is_package: bool = False) -> dict[str, bool]:
    """bestiary module -> whether some import of it is at module level.

    `from pkg import name` counts as `pkg.name` when that is a module in `known`, else as `pkg`."""
    found: dict[str, bool] = {}
    for base, names, top in import_statements(source, me, is_package):
        for n in names or ("",):
            target = f"{base}.{n}" if f"{base}.{n}" in known else base
            if target == "bestiary" or target.startswith("bestiary."):
                found[target] = found.get(target, False) or top
    return found


def package_of(module: str) -> str | None:
    """The layered package a module belongs to (short name), or None (models, the root)."""
    for name, full in PACKAGES.items():
        if module == full or module.startswith(full + "."):
            return name
    return None


def violations(files: dict[str, str], packages: frozenset[str] = frozenset()) -> list[str]:
    """`module -> source` in (`packages`: the modules that are packages), one line per import that
    breaks the rules out."""
    bad = []
    for me, source in sorted(files.items()):
        mine = package_of(me)
        for target, top in sorted(imports_of(source, me, set(files), me in packages).items()):
            if me.startswith("bestiary.models."):
                own = ".".join(me.split(".")[:3])
                ok = target.startswith(own) or any(target == p or target.startswith(p + ".") for p in PLUGIN_API)
                if target.startswith("bestiary.core") and not ok:
                    bad.append(f"{me} imports {target} (models import only the plugin API)")
                continue
            theirs = package_of(target)
            if mine is None or theirs is None or theirs == mine:
                continue
            if (me, target) in LAZY_EXCEPTIONS and not top:
                continue
            if LAYER_OF[theirs] >= LAYER_OF[mine]:
                where = "a sibling" if LAYER_OF[theirs] == LAYER_OF[mine] else "a layer above"
                at = " at module level" if (me, target) in LAZY_EXCEPTIONS else ""
                bad.append(f"{me} imports {target}{at} ({mine} may not import {theirs}: {where})")
    return bad


def tree_files() -> tuple[dict[str, str], frozenset[str]]:
    """(module -> source, the modules that are packages) of core, models, registry, plugins, testing."""
    out, packages = {}, set()
    for folder in ("core", "models", "registry", "plugins", "testing"):
        for path in (ROOT / folder).rglob("*.py"):
            name = module_name(path)
            out[name] = path.read_text()
            if path.name == "__init__.py":
                packages.add(name)
    return out, frozenset(packages)


def package_graph(files: dict[str, str], packages: frozenset[str], module_level: bool,
                  skip: frozenset = frozenset()) -> dict[str, set[str]]:
    """Layered package -> the layered packages its modules import (only module-level imports, or all),
    leaving out the (module, target) edges in `skip`."""
    graph: dict[str, set[str]] = defaultdict(set)
    for me, source in files.items():
        mine = package_of(me)
        for target, top in imports_of(source, me, set(files), me in packages).items():
            theirs = package_of(target)
            if mine and theirs and theirs != mine and (top or not module_level) and (me, target) not in skip:
                graph[mine].add(theirs)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def allowed(name: str) -> list[str]:
    """The packages `name` may import: every package of a lower layer, bottom first."""
    return [p for layer in LAYERS[: LAYER_OF[name]] for p in layer]


# --- the tree -------------------------------------------------------------------------------


def test_tree_follows_the_import_rules():
    assert violations(*tree_files()) == []


def test_no_cycle_between_packages():
    """Neither the module-level graph nor the one with function-level imports (the lazy exceptions
    aside) has a cycle between packages."""
    files, packages = tree_files()
    assert cycles(package_graph(files, packages, module_level=True)) == []
    assert cycles(package_graph(files, packages, module_level=False, skip=frozenset(LAZY_EXCEPTIONS))) == []
    assert cycles(package_graph(files, packages, module_level=False)) == [["convert", "runtime"]]  # the exceptions


def test_every_lazy_exception_is_still_an_import_inside_a_function():
    files, packages = tree_files()
    for (me, target), why in LAZY_EXCEPTIONS.items():
        found = imports_of(files[me], me, set(files), me in packages)
        assert found.get(target) is False, f"{me} -> {target} ({why}): gone or at module level; update LAZY_EXCEPTIONS"


def test_every_core_module_lives_in_a_layered_package():
    loose = sorted(p.name for p in (ROOT / "core").glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in (ROOT / "core").iterdir() if (p / "__init__.py").is_file())
    assert loose == [] and set(folders) == {n for n, full in PACKAGES.items() if full.startswith("bestiary.core.")}


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_package_docstrings_state_the_rule(name):
    """Each package's docstring says its layer and what it may import, as LAYERS does."""
    doc = importlib.import_module(PACKAGES[name]).__doc__ or ""
    below = allowed(name)
    expected = f"May import: {', '.join(below)}." if below else "May import: nothing of bestiary."
    assert f"Layer {LAYER_OF[name]} of the core" in doc and expected in " ".join(doc.split()), (
        f"{PACKAGES[name]}'s docstring should say 'Layer {LAYER_OF[name]} of the core' and '{expected}'")


# --- planted violations: each rule reports what breaks it ----------------------------------------

# One module of each layered package (the violation is planted there) and one module to import from each.
SAMPLE = {
    "format": "bestiary.core.format.config", "plugins": "bestiary.plugins.hookspecs",
    "sources": "bestiary.core.sources.base", "kernels": "bestiary.core.kernels.dispatch",
    "registry": "bestiary.registry.spec", "layers": "bestiary.core.layers.mlp", "quant": "bestiary.core.quant.slot",
    "lora": "bestiary.core.lora.batch", "runtime": "bestiary.core.runtime.executor",
    "convert": "bestiary.core.convert.loader", "bench": "bestiary.core.bench.run", "serve": "bestiary.core.serve.protocol",
    "cli": "bestiary.core.cli.main", "testing": "bestiary.testing.suite",
}
UPWARD = [(name, other) for name in PACKAGES for other in PACKAGES
          if LAYER_OF[other] >= LAYER_OF[name] and other != name
          and (LAYER_OF[other] == LAYER_OF[name] or LAYER_OF[other] == LAYER_OF[name] + 1)]


def _plant(module: str, line: str) -> list[str]:
    files, packages = tree_files()
    files[module] = files[module] + "\n" + line + "\n"
    return violations(files, packages)


@pytest.mark.parametrize("name,other", UPWARD, ids=[f"{a}->{b}" for a, b in UPWARD])
def test_a_planted_upward_import_is_reported(name, other):
    """A sibling or the layer above, imported at module level or inside a function, is reported."""
    module, target = SAMPLE[name], SAMPLE[other]
    leaf = target.rsplit(".", 1)
    for line in (f"from {leaf[0]} import {leaf[1]}", f"def _f():\n    import {target}\n"):
        found = _plant(module, line)
        assert len(found) == 1 and found[0].startswith(f"{module} imports {target}"), found


def test_a_planted_type_checking_import_is_reported():
    found = _plant("bestiary.core.kernels.dispatch", "if TYPE_CHECKING:\n    from bestiary.core.layers.linear import Linear\n")
    assert len(found) == 1 and "kernels may not import layers" in found[0]


def test_a_lazy_exception_at_module_level_is_reported():
    found = _plant("bestiary.core.runtime.llm", "from bestiary.core.convert.source_to_checkpoint import convert")
    assert found == ["bestiary.core.runtime.llm imports bestiary.core.convert.source_to_checkpoint at module level "
                     "(runtime may not import convert: a layer above)"]


def test_the_lazy_exceptions_are_the_only_ones():
    """The same import from another runtime module is reported, even inside a function."""
    found = _plant("bestiary.core.runtime.engine", "def _f():\n    from bestiary.core.convert.source_to_checkpoint import convert\n")
    assert len(found) == 1 and found[0].startswith("bestiary.core.runtime.engine imports")


@pytest.mark.parametrize(("module", "line"), [
    ("bestiary.models.llama.model", "from bestiary.core.runtime.executor import Executor"),
    ("bestiary.models.opt.model", "from bestiary.core.quant.modes import QuantMode"),
    ("bestiary.models.qwen.model", "from bestiary.core.kernels.metadata import AttentionMetadata"),
])
def test_a_planted_model_violation_is_reported(module, line):
    found = _plant(module, line)
    assert len(found) == 1 and found[0].endswith("(models import only the plugin API)"), found


def test_relative_imports_resolve():
    files, packages = tree_files()
    files["bestiary.core.runtime.engine"] += "\nfrom ..convert import source_to_checkpoint\n"
    files["bestiary.core.kernels"] += "\nfrom ..layers import mlp\n"
    assert [v.split(" (")[0] for v in violations(files, packages)] == [
        "bestiary.core.kernels imports bestiary.core.layers.mlp",
        "bestiary.core.runtime.engine imports bestiary.core.convert.source_to_checkpoint"]


# --- data that moved with the layers ---------------------------------------------------------


def test_calibration_text_is_package_data_and_byte_identical():
    """The calibration texts are unchanged (the quantization gates must not move)."""
    from bestiary.core.convert.calibration import BUILTIN_TEXT
    from bestiary.core.quant.calib_text import WEIGHT_CALIB_TEXT

    assert hashlib.sha256(WEIGHT_CALIB_TEXT.encode()).hexdigest() == (
        "3ee5c6b90296727a6d40731476b213515ec4d76185b797b9acc42515188d10c7")
    assert hashlib.sha256(BUILTIN_TEXT.encode()).hexdigest() == (
        "0424354b455b5e537e45264c274de5a79d7a6b0b4ba89c11c858da16ca56b22c")
    assert len((ROOT / "core" / "quant" / "calib_text.py").read_text().splitlines()) < 60


def main() -> None:
    """Print the package graph (module-level, then with function-level imports) and its cycles."""
    files, packages = tree_files()
    for module_level in (True, False):
        graph = package_graph(files, packages, module_level)
        print(f"{'module-level' if module_level else 'all (function-level too)'} imports between packages:")
        for name in sorted(graph, key=lambda n: (LAYER_OF[n], n)):
            print(f"  {name} (layer {LAYER_OF[name]}) -> {', '.join(sorted(graph[name], key=LAYER_OF.get))}")
        print(f"  cycles: {cycles(graph) or 'none'}")
    lazy = package_graph(files, packages, False, frozenset(LAZY_EXCEPTIONS))
    print(f"all imports but the lazy exceptions ({', '.join(f'{a} -> {b}' for a, b in LAZY_EXCEPTIONS)}): "
          f"cycles: {cycles(lazy) or 'none'}")
    found = violations(files, packages)
    print(f"rule violations: {len(found)}" + "".join(f"\n  {v}" for v in found))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
