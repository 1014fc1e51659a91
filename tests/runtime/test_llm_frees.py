"""A dropped LLM frees its engine at once (reference counting), and the bench holds one system at a time.

The model cached its compiled decode plans and each plan held the model: a cycle, so a dropped LLM's
weights stayed until the cycle collector ran. `bestiary bench --shape llama-3.2-3b --rounds 3` held
every engine it had opened (22 GiB anonymous memory, killed by the OOM killer on a 24 GiB machine).
"""

from __future__ import annotations

import gc
import weakref

import pytest

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama

from bestiary.core.bench import run as bench_run
from bestiary.core.bench.config import BenchConfig
from bestiary.core.bench.peers import Candidate
from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frees")
    convert(make_tiny_llama(tmp / "hf"), tmp / "ckpt", ConvertOptions(dtype="float32"), show_progress=False)
    build_engine(tmp / "ckpt", tmp / "engine", BuildConfig(max_batch_size=4, max_seq_len=64))
    return tmp / "engine"


def test_dropped_llm_frees_its_model_without_the_cycle_collector(engine):
    llm = LLM(engine)
    llm.generate([[5, 17, 3], [7, 8]], SamplingConfig(max_new_tokens=4))  # decode plans built and cached
    assert llm.executor.model.__dict__.get("_decode_plans"), "the test needs the model's cached plans"
    model, executor = weakref.ref(llm.executor.model), weakref.ref(llm.executor)
    gc.disable()
    try:
        llm.close()
        del llm
        assert executor() is None and model() is None, "a reference cycle keeps the engine's weights alive"
    finally:
        gc.enable()


class _Tracked:
    """A system that records, when it opens, whether the previously opened one is still alive."""

    opened: list[weakref.ref] = []
    alive_at_open: list[bool] = []

    def __init__(self) -> None:
        _Tracked.alive_at_open.append(any(ref() is not None for ref in _Tracked.opened))
        _Tracked.opened.append(weakref.ref(self))

    def close(self) -> None:
        pass


def test_bench_round_drops_each_system_before_opening_the_next(monkeypatch):
    monkeypatch.setattr(bench_run, "measure", lambda *args: None)
    gc.disable()
    try:
        cands = [Candidate(f"s{i}", f"s{i}", open=_Tracked) for i in range(3)]
        rows = bench_run.measure_round(BenchConfig(), cands, vocab=64, on_step=lambda _: None)
    finally:
        gc.enable()
    assert [r.name for r in rows] == ["s0", "s1", "s2"]
    assert _Tracked.alive_at_open == [False, False, False]
