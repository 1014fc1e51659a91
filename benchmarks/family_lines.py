"""Code lines per built-in family (docs/models.md "How each family is written").

Counts the lines of code of each package under models/ (docstrings, comments and blank lines
left out), imports counted apart:

    python benchmarks/family_lines.py            # family, code, imports, files (tab-separated)
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers of every module, class and function docstring."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, DOCUMENTED) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.update(range(first.lineno, first.end_lineno + 1))
    return out


def count_file(source: str) -> tuple[int, int]:
    """(code lines that are not imports, import lines) of one Python source."""
    tree = ast.parse(source)
    imports = {n for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               for n in range(node.lineno, node.end_lineno + 1)}
    code = {n for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type not in SKIP
            for n in range(tok.start[0], tok.end[0] + 1)} - docstring_lines(tree)
    return len(code - imports), len(code & imports)


def family_lines(models: Path = ROOT / "models") -> dict[str, tuple[int, int, int]]:
    """family -> (code lines, import lines, files) of each package under `models`."""
    out = {}
    for package in sorted(p for p in models.iterdir() if (p / "__init__.py").exists()):
        files = sorted(package.glob("*.py"))
        counts = [count_file(f.read_text()) for f in files]
        out[package.name] = (sum(c for c, _ in counts), sum(i for _, i in counts), len(files))
    return out


if __name__ == "__main__":
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models"
    for name, (code, imports, files) in family_lines(folder).items():
        print(f"{name}\t{code}\t{imports}\t{files}")
