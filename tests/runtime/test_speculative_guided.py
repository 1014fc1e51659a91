"""Speculative decoding of guided requests (core.runtime.guided) with a draft engine: the draft model proposes
free text, the grammar cuts each draft to the prefix it accepts, verification masks every row and rolls back
the rejected tail. Greedy output equals plain guided decoding token for token, with a fixed k and with the
adaptive k (deterministic costs: a fake clock). Tiny random chat engine (tests/helpers/tiny_chat.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

from test_guided import PROMPT, SPEC_PROMPTS, guided, json_valid  # noqa: E402
from test_speculative import FakeClock  # noqa: E402
from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return make_tiny_chat_engine(tmp_path_factory.mktemp("spec_guided"), max_batch_size=8, max_seq_len=256)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """Another random model with the same tokenizer: its drafts are mostly rejected."""
    return make_tiny_chat_engine(tmp_path_factory.mktemp("spec_guided_other"), max_batch_size=8, seed=5)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_engine_guided_equals_plain(engine_dir, other_dir, monkeypatch, adaptive, draft):
    """The engine drafting for itself (its grammar-cut drafts are all accepted) and another random model
    (mostly rejected): every guided output equals plain guided greedy decoding and is valid JSON."""
    from bestiary.core.runtime import speculative

    monkeypatch.setattr(speculative, "time", FakeClock())
    plain = LLM(engine_dir)
    drafter = engine_dir if draft == "self" else other_dir
    spec = LLM(engine_dir, speculative={"method": "draft", "draft_engine_dir": str(drafter), "num_draft_tokens": 4,
                                        "adaptive": adaptive})
    prompts = [*SPEC_PROMPTS, PROMPT]
    configs = [guided(temperature=0.0)] * 3 + [SamplingConfig(max_new_tokens=40, temperature=0.0)]
    expected = plain.generate(prompts, configs)
    for batch in (prompts, prompts[:1]):  # a batch of four, then batch 1
        got = spec.generate(batch, configs[: len(batch)])
        assert [o.output_ids for o in got] == [o.output_ids for o in expected[: len(batch)]]
    fast = spec.generate(prompts, configs)
    for out in fast[:3]:
        assert out.finish_reason == "stop" and json_valid(out.text), out.text
        json.loads(out.text or "")
    total = spec.executor.speculator.stats
    assert total.accepted > 0, total
    if draft == "other":
        assert total.drafted > total.accepted, total  # rejected drafts: the rollback ran
