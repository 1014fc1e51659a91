"""benchmarks/soak.py on a tiny engine: 3 rounds of 200 concurrent streaming clients, 20% hanging up (slow suite)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tiny_chat import make_tiny_chat_engine  # noqa: E402

pytestmark = pytest.mark.slow
SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_soak_three_rounds_of_200_streaming_clients(tmp_path):
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = soak  # its dataclasses look their module up
    spec.loader.exec_module(soak)
    engine = make_tiny_chat_engine(tmp_path, max_batch_size=64)
    args = soak.parse_args(["--engine_dir", str(engine), "--clients", "200", "--rounds", "3", "--max_tokens", "32",
                            "--disconnect", "0.2", "--max_queue_len", "256", "--round_timeout", "600",
                            "--log", str(tmp_path / "server.log")])
    results, failures = soak.soak(args)
    assert failures == []
    assert len(results) == 3
    for r in results:
        assert r.disconnected >= 20 and r.completed >= 100  # ~20% hung up, the rest read to the end
        assert r.kv_used_after == 0
