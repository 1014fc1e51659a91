"""The folders whose modules tests import by name: tests/helpers (parity, tiny_llama, ...) and every
test folder (a test module may reuse another's fixtures or references, e.g. test_zoo_remote's).

tests/conftest.py calls `add()` before any test module is imported; scripts of benchmarks/ that reuse
the tests' helpers call it too (after putting tests/ itself on sys.path).
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def folders() -> list[Path]:
    """tests/helpers, then every folder under tests/ that holds test modules (tests/data aside)."""
    found = sorted({p.parent for p in TESTS.rglob("test_*.py") if "data" not in p.relative_to(TESTS).parts})
    return [TESTS / "helpers", *(f for f in found if f != TESTS)]


def add() -> None:
    """Put `folders()` on sys.path (once)."""
    for folder in reversed(folders()):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
