"""Test-wide settings: deterministic, few threads, no network."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tests/data/ holds plugin packages with their own test suites (run from their own directories,
# e.g. by test_third_party_qwen2.py), not tests of this suite.
collect_ignore = ["data"]
