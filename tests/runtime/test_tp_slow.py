"""Slow multi-rank checks: SmolLM2-135M (9 heads, 3 kv heads) at tp 3, pp 2 and pp 3, the mixed
in-flight workload (prompts of 4..400 tokens, staggered arrivals) on tp 2 and tp 2 x pp 2 engines,
and worker groups of two sizes in one process."""

from __future__ import annotations

import random

import pytest
from test_executor import alone, executor, staggered
from test_tp_runtime import STEPS, first_near_tie, teacher_forced
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.core.runtime.step_broadcast import check_mirror

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2), (1, 3)])
def test_smollm2_parallel_equals_tp1(smollm2_gguf, smollm2_fp32_checkpoint, tmp_path, tp, pp):
    """fp32 at tp 3 (9 heads, 3 kv heads) and on 2 and 3 pipeline stages (30 layers: 15 + 15, 10 x 3):
    logits within 1e-4 (max abs) over the prefill and 16 decode steps, same greedy text."""
    tp1 = smollm2_fp32_checkpoint  # the session's fp32 tp 1 checkpoint (tests/conftest.py)
    other = convert(smollm2_gguf, tmp_path / "other", ConvertOptions(dtype="float32", tp_size=tp, pp_size=pp),
                    show_progress=False)
    reference = LLM(tp1)
    prompt = reference.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    ref, tokens = teacher_forced(reference.engine, prompt)
    llm = LLM(other, num_threads=1)
    try:
        ours, _ = teacher_forced(llm.engine, prompt, tokens)
        worst = (ours - ref).abs().max().item()
        print(f"SmolLM2 tp {tp} pp {pp} vs tp 1: max |logit diff| {worst:.3g} over prefill + {STEPS} decode steps")
        assert worst <= 1e-4
        sampling = SamplingConfig(max_new_tokens=STEPS, **GREEDY)
        agree = first_near_tie(ref)  # rows: prefill, then decode steps; greedy token i comes from row i
        assert agree >= STEPS * 3 // 4, f"tp 1 near-tie at step {agree}"
        ours_ids = llm.generate([prompt], sampling)[0].output_ids
        assert ours_ids[:agree] == tokens[:agree] == reference.generate([prompt], sampling)[0].output_ids[:agree]
        check_mirror(llm.engine)
    finally:
        llm.close()


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_mixed_inflight_workload_equals_each_alone_on_tp1(tmp_path, tp, pp):
    """Prompts of 4..400 tokens with staggered arrivals on tp 2 and on tp 2 x pp 2 (the in-flight
    batch cut into micro-batches): every request's tokens equal its run alone on tp 1."""
    src = make_tiny_llama(tmp_path, max_position_embeddings=512, num_key_value_heads=1)
    tp1 = Engine.load(convert(src, tmp_path / "tp1", show_progress=False))
    llm = LLM(convert(src, tmp_path / "other", ConvertOptions(tp_size=tp, pp_size=pp), show_progress=False),
              num_threads=1)
    try:
        rng = random.Random(0)
        lengths = [4, 400, 37, 5, 180, 64, 9, 250, 16, 120]
        work = [([rng.randrange(3, 96) for _ in range(n)], rng.randint(2, 24)) for n in lengths]
        ex = executor(llm.engine, max_batch_size=4, max_num_tokens=96)
        reqs = staggered(ex, work, rng)
        for (prompt, n), req in zip(work, reqs):
            assert req.output == alone(tp1, prompt, n), f"prompt of {len(prompt)} tokens"
        ex.check_kv_accounting()
        check_mirror(llm.engine)
    finally:
        llm.close()




def test_an_llm_dropped_without_close_does_not_pin_its_worker_group(tmp_path):
    """A 3-rank LLM left for the garbage collector (no close()) must not refuse a 2-rank one
    later in the process (it did: "this process runs a 3-rank engine"), and a live one must."""
    import gc

    from bestiary.core.format.errors import BestiaryError
    from bestiary.core.runtime import worker_group

    src = make_tiny_llama(tmp_path, hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=1)
    tp1 = LLM(convert(src, tmp_path / "tp1", show_progress=False))
    sampling = SamplingConfig(max_new_tokens=6, **GREEDY)
    expected = tp1.generate([[5, 9, 14]], sampling)[0].output_ids
    tp3 = LLM(convert(src, tmp_path / "tp3", ConvertOptions(tp_size=3), show_progress=False), num_threads=1)
    assert tp3.generate([[5, 9, 14]], sampling)[0].output_ids == expected
    tp2_dir = convert(src, tmp_path / "tp2", ConvertOptions(tp_size=2), show_progress=False)
    with pytest.raises(BestiaryError, match="runs a 3-rank engine"):
        LLM(tp2_dir, num_threads=1)  # tp3 is alive: refused, tp3 still runs
    assert tp3.generate([[5, 9, 14]], sampling)[0].output_ids == expected
    del tp3
    gc.collect()
    tp2 = LLM(tp2_dir, num_threads=1)
    try:
        assert worker_group._CURRENT.world_size == 2
        assert tp2.generate([[5, 9, 14]], sampling)[0].output_ids == expected
        check_mirror(tp2.engine)
    finally:
        tp2.close()
