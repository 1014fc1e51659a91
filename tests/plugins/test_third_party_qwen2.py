"""A Qwen2 family written only with the public plugin API, checked by the conformance kit.

tests/data/qwen2_plugin/ is a separate package (its own pyproject.toml and entry point, not a
built-in). Its own test module is one `bestiary.testing.conformance(...)` line; here pytest runs
it from the package's directory, as the package's CI would, and the plugin's size is held to
the issue's budget.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1] / "data" / "qwen2_plugin"


def code_lines(path: Path) -> int:
    """Non-blank, non-comment, non-docstring lines of a Python file (imports included)."""
    src = path.read_text()
    docs: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines = {n for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type not in skip
             for n in range(tok.start[0], tok.end[0] + 1)}
    return len(lines - docs)


def test_plugin_fits_in_60_lines():
    sizes = {p.name: code_lines(p) for p in sorted((PLUGIN / "bestiary_qwen2").glob("*.py"))}
    assert 0 < sum(sizes.values()) <= 60, sizes


def test_code_lines_counts_code_only(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text('"""Doc\nstring."""\n\nimport os  # comment\n# only a comment\n\n\ndef f():\n    """Doc."""\n'
                      "    return (1,\n            2)\n")
    assert code_lines(sample) == 4  # import, def, and the two lines of the return


def test_plugin_is_checked_as_itself_not_as_the_built_in_qwen2():
    """bestiary has a built-in Qwen2ForCausalLM too: from the plugin's directory the kit's registry holds the
    plugin's spec in its place (local_registry overrides), while the default registry keeps the built-in."""
    from bestiary.registry import default_registry
    from bestiary.testing import local_registry

    assert default_registry().get("Qwen2ForCausalLM").config_class.startswith("bestiary.models.qwen2.")
    local = local_registry(PLUGIN / "tests")
    assert local.get("Qwen2ForCausalLM").config_class == "bestiary_qwen2.model:Qwen2Config"
    assert local.get("LlamaForCausalLM").package == "bestiary"  # the built-ins are all still there


def test_conformance_suite_passes_from_the_plugin_directory():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"], cwd=PLUGIN,
                         capture_output=True, text=True, timeout=900)
    tail = run.stdout[-3000:]
    assert run.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", tail).group(1))
    assert passed >= 14 and "failed" not in tail, tail  # 8 checks x 2 configs; the CPU-plan check may skip
