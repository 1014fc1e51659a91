"""The pytest plugin of the conformance kit (entry point `pytest11: bestiary`).

Loaded by pytest at start-up in every project once bestiary is installed, so it stays light:
it keeps Hugging Face libraries offline (tests never download) and declares the `slow`
marker. The tests themselves come from `bestiary.testing.conformance(...)` (one line per family).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Offline HF, quiet tokenizers; the `slow` marker for long real-model tests."""
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)
    config.addinivalue_line("markers", "slow: long-running tests (real model); deselect with -m 'not slow'")
