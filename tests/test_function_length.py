"""No function of the package runs over MAX_LINES lines (its def line to its last, nested functions
included): a longer one is split into named steps. Tests, benchmarks and docs are not the package.

    python tests/test_function_length.py [N]     prints the N (default 10) longest functions
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 80
NOT_PACKAGE = {"tests", "benchmarks", "docs", "build", "site", "testing_data"}


def package_files(root: Path = ROOT) -> list[Path]:
    """The package's .py files: the repo root's own and its package directories' (those with an
    __init__.py), but tests, benchmarks, build output and dot dirs."""
    tops = [d for d in root.iterdir() if d.is_dir() and d.name not in NOT_PACKAGE and not d.name.startswith(".")
            and (d / "__init__.py").is_file()]
    return sorted([*root.glob("*.py"), *(p for d in tops for p in d.rglob("*.py"))])


def function_lengths(source: str, where: str) -> list[tuple[int, str]]:
    """(lines, "where:line name") for every function and method in `source`, nested ones too."""
    return [(node.end_lineno - node.lineno + 1, f"{where}:{node.lineno} {node.name}")
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None]


def longest(root: Path = ROOT) -> list[tuple[int, str]]:
    """Every package function's length, longest first."""
    rows = [row for p in package_files(root) for row in function_lengths(p.read_text(), str(p.relative_to(root)))]
    return sorted(rows, key=lambda row: (-row[0], row[1]))


def test_no_package_function_is_over_max_lines():
    over = [f"{name} ({n} lines)" for n, name in longest() if n > MAX_LINES]
    assert not over, f"functions over {MAX_LINES} lines (split them into named steps): " + "; ".join(over)


def test_the_walk_covers_the_package():
    names = {str(p.relative_to(ROOT)) for p in package_files()}
    assert {"core/convert/source_to_checkpoint.py", "testing/suite.py", "models/llama/model.py"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/", ".venv/", "build/")) for n in names)


def test_a_long_function_is_measured_with_its_nested_ones():
    body = "\n".join(f"    x{i} = {i}" for i in range(3))
    source = f"def outer():\n    def inner():\n        pass\n{body}\n\nasync def other():\n    pass\n"
    assert sorted(function_lengths(source, "m.py"), key=lambda row: row[1]) == [(6, "m.py:1 outer"), (2, "m.py:2 inner"), (2, "m.py:8 other")]


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    for n, name in longest()[:count]:
        print(f"{n:5d}  {name}")
