"""The model zoo on a tensor-parallel engine: every case of test_zoo_hf / test_zoo_remote converted at tp 2
and run by two worker ranks matches its reference (transformers, or the transcribed upstream forward) within the
conformance kit's bound, over the prefill and 6 greedy decode steps."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import test_zoo_hf  # noqa: E402
import test_zoo_remote  # noqa: E402

pytestmark = pytest.mark.slow
CASES = {f"{arch}-{name}": case for arch, cases in (test_zoo_hf.ZOO | test_zoo_remote.ZOO).items()
         for name, case in cases.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_engine_matches_the_reference(name, tmp_path):
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.runtime.llm import LLM
    from bestiary.testing.parity import reference_diffs
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT

    reference = as_reference(CASES[name])
    source = reference.save(tmp_path / "source")
    llm = LLM(convert(source, tmp_path / "tp2", ConvertOptions(tp_size=2), show_progress=False), num_threads=1)
    try:
        assert llm.engine.model.tp_size == 2
        diff, scale = reference_diffs(llm.engine, reference.logits, PROMPT, 6, 0)
    finally:
        llm.close()
    assert diff <= 1e-4 * max(1.0, scale), f"{name}: tp 2 max|ours - reference| {diff:.3e}"
