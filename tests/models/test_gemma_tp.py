"""Gemma 2 / Gemma 3 on tensor-parallel engines: each case of test_gemma2 / test_gemma3 converted at tp 2 and run
by two worker ranks matches transformers within the conformance kit's bound over the prefill and 16 greedy decode
steps (past the window of 4), and generates the same greedy tokens as the tp 1 engine. Also tp 2 x pp 2 (4 ranks)
for the case with a soft-capped attention, whose last stage applies the final-logit soft-cap."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import test_gemma2  # noqa: E402
import test_gemma3  # noqa: E402

pytestmark = pytest.mark.slow
CASES = {f"Gemma2-{name}": case for name, case in test_gemma2.GEMMA2.items()} | {
    f"Gemma3-{name}": case for name, case in test_gemma3.GEMMA3.items()}


def greedy(llm, prompt: list[int], steps: int) -> list[int]:
    from bestiary.core.runtime.sampling import SamplingConfig

    (out,) = llm.generate([prompt], SamplingConfig(max_new_tokens=steps, temperature=0.0, ignore_eos=True))
    return list(out.output_ids)


# every case at tp 2; one at tp 2 x pp 2 (4 ranks on 2 cores)
LAYOUTS = [(name, 2, 1) for name in sorted(CASES)] + [("Gemma2-window_softcaps", 2, 2)]


@pytest.mark.parametrize("name,tp,pp", LAYOUTS, ids=[f"{n}-tp{t}pp{p}" for n, t, p in LAYOUTS])
def test_tp2_matches_the_reference_and_tp1(name, tp, pp, tmp_path):
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.llm import LLM
    from bestiary.testing.parity import reference_diffs
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT

    reference = as_reference(CASES[name])
    source = reference.save(tmp_path / "source")
    one = LLM(convert(source, tmp_path / "tp1", show_progress=False), num_threads=1)
    try:
        expected = greedy(one, PROMPT, 16)
    finally:
        one.close()
    llm = LLM(convert(source, tmp_path / "tp2", ConvertOptions(tp_size=tp, pp_size=pp), show_progress=False),
              num_threads=1)
    try:
        assert llm.engine.model.tp_size == tp
        diff, scale = reference_diffs(llm.engine, reference.logits, PROMPT, 16, 0)
        tokens = greedy(llm, PROMPT, 16)
    finally:
        llm.close()
    assert diff <= 1e-4 * max(1.0, scale), f"{name}: tp {tp} pp {pp} max|ours - reference| {diff:.3e}"
    assert tokens == expected, f"{name}: tp {tp} pp {pp} greedy {tokens} != tp 1 {expected}"
