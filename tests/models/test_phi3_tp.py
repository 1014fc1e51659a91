"""Phi-3 at tp 2 (two worker ranks): every variant of test_phi3.PHI3 matches transformers and its own tp 1 engine
over the prefill and 16 greedy decode steps (the fused qkv_proj / gate_up_proj cut per rank, GQA and MHA, LongRoPE
on both sides of its switch, partial rotary, tied lm_head)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from test_phi3 import PHI3  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(PHI3))
def test_tp2_matches_tp1_and_transformers(name, tmp_path):
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.core.runtime.llm import LLM
    from bestiary.testing.parity import EngineRunner, reference_diffs
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT

    reference = as_reference(PHI3[name])
    source = reference.save(tmp_path / "source")
    tp1 = Engine.load(convert(source, tmp_path / "tp1", show_progress=False))
    llm = LLM(convert(source, tmp_path / "tp2", ConvertOptions(tp_size=2), show_progress=False), num_threads=1)
    try:
        assert llm.engine.model.tp_size == 2
        diff, scale = reference_diffs(llm.engine, reference.logits, PROMPT, 16, 0)
        vs_tp1, _ = reference_diffs(llm.engine, lambda ids: EngineRunner(tp1).feed(ids, all_logits=True),
                                    PROMPT, 16, 0)
    finally:
        llm.close()
    assert diff <= 1e-4 * max(1.0, scale), f"{name}: tp 2 max|ours - transformers| {diff:.3e}"
    assert vs_tp1 <= 1e-4 * max(1.0, scale), f"{name}: tp 2 max|tp 2 - tp 1| {vs_tp1:.3e}"
