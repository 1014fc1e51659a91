"""What a tp 2 engine returns besides greedy ids equals tp 1's: log probs, top log probs,
seeded sampling, `generate_stream` / `generate_async`, and `bestiary eval`'s perplexity.

Same tiny fp32 LLaMA and the same process-wide 2-rank worker group as tests/runtime/test_tp_runtime.py
(its `checkpoints` fixture; `sources` is narrowed here to the one model these tests use, with
a tokenizer). tp 2 logits are within 1e-5 of tp 1's, so log probs agree within 1e-5 and a
seeded draw picks the same token unless a uniform falls within ~1e-6 of a bucket edge.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_tp_runtime import DEFAULT_PROMPT, checkpoints  # noqa: F401 - the fixture, reused
from tiny_llama import make_tiny_llama, write_tiny_tokenizer

from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
from bestiary.core.runtime import engine as engine_module
from bestiary.core.runtime import step_broadcast
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.core.runtime.step_broadcast import check_mirror

LOG_PROB_TOL = 1e-5
PROMPTS = [DEFAULT_PROMPT, [56, 30, 82, 39, 44, 40], [5, 6]]
LONG = 12  # generated tokens per request


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """test_tp_runtime's sources, just the LLaMA (with the tiny tokenizer, for text and eval)."""
    src = make_tiny_llama(tmp_path_factory.mktemp("tp_outputs"))
    write_tiny_tokenizer(src)
    return {"llama": src}


@pytest.fixture(scope="module")
def pair(checkpoints):  # noqa: F811 - pytest's fixture injection
    """(tp 1 LLM, tp 2 LLM) of the tiny LLaMA; tp 2 drives the shared 2-rank group."""
    tp1, tp2 = LLM(checkpoints("llama", 1)), LLM(checkpoints("llama", 2), num_threads=1)
    yield tp1, tp2
    check_mirror(tp2.engine)
    tp2.close()


def test_log_probs_and_top_log_probs_equal_tp1(pair):
    """Greedy with output_log_probs and top_log_probs 4: same ids, and every log prob (chosen and top 4)
    within 1e-5 of tp 1's, the top 4 ids in the same order."""
    sampling = SamplingConfig(temperature=0, max_new_tokens=LONG, ignore_eos=True, output_log_probs=True,
                              top_log_probs=4)
    ref, ours = (llm.generate(PROMPTS, sampling) for llm in pair)
    for a, b in zip(ref, ours):
        assert b.output_ids == a.output_ids
        assert len(b.log_probs) == LONG and b.log_probs == pytest.approx(a.log_probs, abs=LOG_PROB_TOL)
        assert b.cum_log_prob == pytest.approx(a.cum_log_prob, abs=LONG * LOG_PROB_TOL)
        assert [[t for t, _ in step] for step in b.top_log_probs] == [[t for t, _ in step] for step in a.top_log_probs]
        for x, y in zip(a.top_log_probs, b.top_log_probs):
            assert [p for _, p in y] == pytest.approx([p for _, p in x], abs=LOG_PROB_TOL)


def test_seeded_sampling_equals_tp1(pair):
    """temperature 1, top_p 0.9, random_seed: the same tokens and log probs as tp 1, and a tp 2 run
    with another seed differs (the draw is random, not greedy)."""
    def run(llm, seed):
        sampling = SamplingConfig(temperature=1.0, top_p=0.9, random_seed=seed, max_new_tokens=LONG, ignore_eos=True,
                                  output_log_probs=True)
        return llm.generate(PROMPTS, sampling)

    (tp1, tp2), seed = pair, 11
    ref, ours = run(tp1, seed), run(tp2, seed)
    assert [c.output_ids for c in ours] == [c.output_ids for c in ref]
    for a, b in zip(ref, ours):
        assert b.log_probs == pytest.approx(a.log_probs, abs=LOG_PROB_TOL)
    assert [c.output_ids for c in run(tp2, seed + 1)] != [c.output_ids for c in ref]


def test_generate_stream_equals_tp1_generate(pair):
    """generate_stream on tp 2 yields text pieces that join to tp 1's non-streamed text, over more than
    one step (the tokens arrive one step at a time)."""
    tp1, tp2 = pair
    sampling = SamplingConfig(temperature=0, max_new_tokens=LONG, ignore_eos=True)
    (expected,) = tp1.generate([DEFAULT_PROMPT], sampling)
    pieces = list(tp2.generate_stream(DEFAULT_PROMPT, sampling))
    assert len(pieces) > 1 and "".join(pieces) == expected.text
    assert tp2.last_stats.generated_tokens == LONG


def test_generate_async_equals_tp1_generate(pair):
    """Three concurrent generate_async requests (one batch, on the LLM's worker thread) on tp 2: each
    one's streamed ids and log probs equal its non-streamed tp 1 completion."""
    tp1, tp2 = pair
    sampling = SamplingConfig(temperature=0, max_new_tokens=LONG, ignore_eos=True, output_log_probs=True)
    expected = tp1.generate(PROMPTS, sampling)

    async def collect(prompt) -> tuple[list[int], list[float], str | None]:
        ids, log_probs, reason = [], [], None
        async for delta in tp2.generate_async(prompt, sampling):
            ids += delta.token_ids
            log_probs += delta.log_probs or []
            reason = delta.finish_reason
        return ids, log_probs, reason

    async def main():
        return await asyncio.gather(*(collect(p) for p in PROMPTS))

    for (ids, log_probs, reason), ref in zip(asyncio.run(main()), expected):
        assert (ids, reason) == (ref.output_ids, ref.finish_reason)
        assert log_probs == pytest.approx(ref.log_probs, abs=LOG_PROB_TOL)


def test_eval_cli_on_tp2_engine_equals_tp1(checkpoints, tmp_path, capsys, monkeypatch):  # noqa: F811
    """`bestiary eval` (main, in this process: the shared group's ranks) on tp 2 and tp 1 engines: the
    same token count, NLL within 1e-5 and perplexity within 1e-4 relative. The tp 2 engine is released
    afterwards (the CLI process would just exit)."""
    from bestiary.core.cli.main import main

    loaded, real_load = [], engine_module.load_engine

    def load_and_keep(*args, **kwargs):
        loaded.append(real_load(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(engine_module, "load_engine", load_and_keep)  # cmd_eval imports it when called
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(7 * i + 3) % 90}" for i in range(70)))
    results = []
    try:
        for tp in (1, 2):
            engine = build_engine(checkpoints("llama", tp), tmp_path / f"engine_tp{tp}", BuildConfig(max_seq_len=48))
            assert main(["eval", "--engine_dir", str(engine), "--text_file", str(text)]) == 0
            results.append(json.loads(capsys.readouterr().out))
        assert getattr(loaded[1], "group", None) is not None, "the tp 2 engine did not run on the ranks"
        check_mirror(loaded[1])
    finally:
        for engine in loaded:
            step_broadcast.release(engine)
    ref, ours = results
    assert ref["tokens"] == ours["tokens"] == 47 + 21  # 70 tokens: windows of max_seq_len 48 and 22
    assert ours["nll"] == pytest.approx(ref["nll"], abs=LOG_PROB_TOL)
    assert ours["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)
