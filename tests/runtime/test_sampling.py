"""Sampling config, logits processors (vs HF's and hand-written references), stop words, outputs, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_beam import make_executor, make_tiny_pair, run_checked  # noqa: E402
from transformers.generation import logits_process as hf_lp  # noqa: E402

from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.kernels.sampling_ref import filter_logits
from bestiary.core.runtime.logits_processors import LogitsPipeline  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig, TokenChooser, make_generator, pad_outputs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, bestiary engine) of the same tiny random LLaMA."""
    return make_tiny_pair(tmp_path_factory.mktemp("sampling"))

V = 50


def states_and_ids(pipeline: LogitsPipeline, prompts: list[list[int]], outputs: list[list[int]]):
    """Processor states built by push() per output token, and HF's input_ids [N, L] (prompt + output)."""
    states = []
    for prompt, output in zip(prompts, outputs):
        state = pipeline.new_state(prompt)
        for t in output:
            state.push(t)
        states.append(state)
    rows = [p + o for p, o in zip(prompts, outputs)]
    return states, torch.tensor(rows) if len({len(r) for r in rows}) == 1 else None


PROMPTS = [[5, 6, 7, 3], [1, 1, 2, 30], [40, 41, 42, 43]]
OUTPUTS = [[8, 3], [1, 2], [9, 10]]  # rows end with 3 / 1, 2 / 10: prefixes of the bad words below
BAD = [[7], [3, 9], [1, 2, 4], [9, 10, 33], [12, 10, 34]]


def scores(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("which", ["repetition", "bad_words", "min_length", "all"])
def test_processors_equal_hf(which):
    """Repetition penalty (prompt + output), bad words (multi-token), min new tokens: HF's values exactly."""
    cfg = {"repetition": {"repetition_penalty": 1.7}, "bad_words": {"bad_words": BAD},
               "min_length": {"min_length": 3, "end_id": 11}}
    hf = {"repetition": hf_lp.RepetitionPenaltyLogitsProcessor(1.7),
              "bad_words": hf_lp.NoBadWordsLogitsProcessor(BAD),
              "min_length": hf_lp.MinNewTokensLengthLogitsProcessor(4, 3, [11, 2])}
    names = list(cfg) if which == "all" else [which]
    fields = {k: v for n in names for k, v in cfg[n].items()}
    pipeline = LogitsPipeline(SamplingConfig(**fields), V, [11, 2])
    states, ids = states_and_ids(pipeline, PROMPTS, OUTPUTS)
    x = scores()
    ref = x.clone()
    for n in names:
        ref = hf[n](ids, ref)
    ours = pipeline(x, states)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, x)
    if "bad_words" in names:  # the multi-token bans fired (9 after 3, 4 after 1 2, 33 after 9 10), 34 did not
        assert ours[0, 9] == float("-inf") and ours[1, 4] == float("-inf") and ours[2, 33] == float("-inf")
        assert ours[2, 34] != float("-inf")


def test_repetition_penalty_covers_the_prompt():
    """Broken variant: penalising the output only (HF's prompt_ignore_length) gives other values."""
    pipeline = LogitsPipeline(SamplingConfig(repetition_penalty=1.7), V, [])
    states, ids = states_and_ids(pipeline, PROMPTS, OUTPUTS)
    output_only = hf_lp.RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=4)(ids, scores())
    assert not torch.equal(pipeline(scores(), states), output_only)


def test_presence_frequency_follow_openai_formula():
    """mu[j] - c[j] * frequency - (c[j] > 0) * presence, c counted over the output only."""
    pipeline = LogitsPipeline(SamplingConfig(presence_penalty=0.6, frequency_penalty=0.45), V, [])
    outputs = [[8, 8, 8, 3], [1, 2, 1], []]
    states, _ = states_and_ids(pipeline, PROMPTS, outputs)
    x = scores(1)
    expected = x.clone()
    for row, output in enumerate(outputs):
        for j in range(V):
            c = output.count(j)
            expected[row, j] = x[row, j] - c * 0.45 - float(c > 0) * 0.6
    torch.testing.assert_close(pipeline(x, states), expected, rtol=0, atol=1e-6)
    assert pipeline(x, states)[0, 5] == x[0, 5]  # a prompt-only token is not penalised


def test_embedding_bias():
    bias = {3: 2.5, 7: -1.0}
    pipeline = LogitsPipeline(SamplingConfig(embedding_bias=bias), V, [])
    x = scores(2)
    out = pipeline(x, [pipeline.new_state([1])] * 3)
    expected = x.clone()
    expected[:, 3] += 2.5
    expected[:, 7] -= 1.0
    assert torch.equal(out, expected)
    full = LogitsPipeline(SamplingConfig(embedding_bias=[0.5] * V), V, [])
    assert torch.equal(full(x, [None] * 3), x + 0.5)
    with pytest.raises(ValueError, match="expected vocab_size = 50"):
        LogitsPipeline(SamplingConfig(embedding_bias=[0.5] * 7), V, [])


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 10, 0.8), (1.3, 0, 0.5), (1.0, 5, 1.0), (0.5, 0, 0.95)])
def test_warpers_equal_hf(temperature, top_k, top_p):
    """filter_logits(x / T, top_k, top_p) == HF's Temperature -> TopK -> TopP warpers."""
    x = scores(3)
    ref = hf_lp.TemperatureLogitsWarper(temperature)(None, x.clone())
    if top_k:
        ref = hf_lp.TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = hf_lp.TopPLogitsWarper(top_p)(None, ref)
    ours = torch.stack([filter_logits(row / temperature, top_k, top_p) for row in x])
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)], rtol=0, atol=0)


def test_top_p_decay_and_reset():
    """top_p_t = max(top_p * decay^t, top_p_min), back to top_p after top_p_reset_ids."""
    cfg = SamplingConfig(top_p=0.9, top_p_decay=0.5, top_p_min=0.2, top_p_reset_ids=4, temperature=1.0)
    chooser = TokenChooser(cfg, make_generator(0), None, [1])
    seen = []
    for token_row in [0, 1, 2, 4, 3]:  # logits that make token `token_row` certain
        row = torch.full((V,), -50.0)
        row[token_row] = 50.0
        seen.append(chooser.top_p)
        assert chooser.choose(row) == token_row
    assert seen == [0.9, 0.45, 0.225, 0.2, 0.9]


def test_config_validation():
    with pytest.raises(ValueError, match="top_p_min"):
        SamplingConfig(top_p=0.3, top_p_min=0.5)
    with pytest.raises(ValueError, match="stop_words"):
        SamplingConfig(stop_words=[[]])
    with pytest.raises(ValueError):
        SamplingConfig(repetition_penalty=0.0)
    encoded = SamplingConfig(stop_words=["ab", [3]], bad_words=["c"]).with_text_encoded(lambda s: [ord(c) for c in s])
    assert encoded.stop_words == [[97, 98], [3]] and encoded.bad_words == [[99]]
    with pytest.raises(ValueError, match="encode it with the tokenizer"):
        SamplingConfig(stop_words=["x"]).token_words("stop_words")


def test_pad_outputs():
    out = pad_outputs([[[1, 2, 3], [4]], [[5]]], pad_id=0)
    assert out.tolist() == [[[1, 2, 3], [4, 0, 0]], [[5, 0, 0], [0, 0, 0]]]


# --- through the executor (tiny LLaMA) --------------------------------------------------------
def generate(engine, prompt, **fields):
    ex = make_executor(engine)
    req = ex.add(prompt, SamplingConfig(**fields))
    run_checked(ex, [req])
    return req


@pytest.mark.parametrize("fields,hf_kwargs", [
    ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
    ({"bad_words": [[49], [85, 2]], "min_length": 6, "end_id": 5},
     {"bad_words_ids": [[49], [85, 2]], "min_new_tokens": 6, "eos_token_id": 5}),
])
def test_greedy_with_processors_equals_hf_generate(tiny, fields, hf_kwargs):
    hf, engine = tiny
    prompt = [5, 17, 33, 2, 61, 7]
    with torch.no_grad():
        kw = {"eos_token_id": None, **hf_kwargs}
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0, **kw)
    req = generate(engine, prompt, max_new_tokens=12, temperature=0.0, **({"ignore_eos": "end_id" not in fields} | fields))
    assert req.chooser is not None
    assert req.output == ref[0, len(prompt):].tolist()
    plain = generate(engine, prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert plain.output != req.output  # the processors changed something


def test_plain_requests_take_the_fast_path(tiny):
    """Greedy and plain sampling requests carry no chooser and no beam search state."""
    _, engine = tiny
    for cfg in ({"temperature": 0.0}, {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "random_seed": 1}):
        req = generate(engine, [1, 2, 3], max_new_tokens=3, **cfg)
        assert req.chooser is None and req.search is None


@pytest.mark.parametrize("fields", [
    {"temperature": 1.0, "top_k": 20, "top_p": 0.9},
    {"temperature": 0.9, "top_p": 0.95, "top_p_decay": 0.9, "repetition_penalty": 1.2, "presence_penalty": 0.3,
         "output_log_probs": True},
])
def test_seeded_sampling_reproducible_and_seed_dependent(tiny, fields):
    _, engine = tiny

    def run(seed):
        return generate(engine, [1, 2, 3], max_new_tokens=16, ignore_eos=True, random_seed=seed, **fields).output

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_stop_words_end_generation_at_the_right_token(tiny):
    """Single- and multi-token stop words stop right after their last token; min_length delays them."""
    _, engine = tiny
    prompt = [4, 8, 15, 16, 23, 42]
    free = generate(engine, prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True).output
    for word in ([free[3]], free[4:6]):
        end = next(i + len(word) for i in range(len(free)) if free[i : i + len(word)] == word)
        req = generate(engine, prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_words=[[90, 91], word])
        assert req.output == free[:end] and req.finish_reason == "stop"
        assert req.chooser is None  # stop words need no processing
    late = generate(engine, prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_words=[free[:1]],
                    min_length=3)
    assert len(late.output) >= 3


def test_log_probs_and_logits_outputs(tiny, tmp_path):
    """Context logits == HF's prompt logits; generation logits == HF's step logits; log probs of them."""
    from parity import hf_logits

    from bestiary.core.runtime.llm import LLM

    hf, engine = tiny
    llm = LLM(engine.directory)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]
    (c,) = llm.generate([prompt], SamplingConfig(max_new_tokens=5, temperature=0.0, ignore_eos=True,
                                                output_log_probs=True, output_context_logits=True,
                                                output_generation_logits=True))
    ref = hf_logits(hf, prompt + c.output_ids)  # [P + 5, V]
    torch.testing.assert_close(c.context_logits, ref[: len(prompt)], rtol=0, atol=1e-4)
    torch.testing.assert_close(c.generation_logits, ref[len(prompt) - 1 : -1], rtol=0, atol=1e-4)
    expected = torch.log_softmax(c.generation_logits, -1).gather(1, torch.tensor(c.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(c.log_probs), expected)
    assert c.cum_log_prob == pytest.approx(sum(c.log_probs))
    (b,) = llm.generate([prompt], SamplingConfig(max_new_tokens=5, beam_width=3, ignore_eos=True))
    assert len(b.beams) == 3 and b.output_ids == b.beams[0].output_ids
    assert b.beams[0].cum_log_prob == pytest.approx(sum(b.beams[0].log_probs), abs=1e-5)
    assert b.beams[0].score == pytest.approx(b.beams[0].cum_log_prob / 5)
    streamed = list(llm.generate_stream(prompt, SamplingConfig(max_new_tokens=5, beam_width=3, ignore_eos=True)))
    assert streamed == b.output_ids  # the best beam, delivered when the search ends
    with pytest.raises(BestiaryError, match="no tokenizer"):
        llm.generate([prompt], SamplingConfig(stop_words=["x"]))
    with pytest.raises(BestiaryError, match="outside the vocabulary"):
        llm.generate([prompt], SamplingConfig(bad_words=[[500]]))
    llm.executor.allocator.check_whole()


def test_cli_sampling_flags(tiny, tmp_path):
    """`bestiary run --num_beams 3 --output_log_probs --stop_words ...` prints the beams as JSON."""
    _, engine = tiny
    cmd = [sys.executable, "-m", "bestiary.core.cli", "run", "--engine_dir", str(engine.directory), "--input_ids",
           "9,8,7", "--max_output_len", "6", "--num_beams", "3", "--length_penalty", "0.5", "--ignore_eos",
           "--repetition_penalty", "1.2", "--output_log_probs", "--output_ids"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    ids_line, record_line = result.stdout.splitlines()
    record = json.loads(record_line)
    assert len(record["beams"]) == 3 and record["beams"][0]["output_ids"] == [int(t) for t in ids_line.split()]
    bad = subprocess.run(cmd[:-4] + ["--top_p", "0.2", "--top_p_min", "0.5"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "top_p_min" in bad.stderr and "Traceback" not in bad.stderr
