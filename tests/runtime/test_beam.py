"""Beam search: HF transformers parity (tiny LLaMA and SmolLM2), KV forks, in-flight mixing, diversity."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

import bestiary.core.runtime.executor as executor_module  # noqa: E402
from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.format.build_config import BuildConfig, finalize_build_config  # noqa: E402
from bestiary.core.runtime.beam import Beam, BeamSearch, fork_block_tables  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.executor import Executor  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig, pad_outputs  # noqa: E402

PAD = 95
# Prompts of the tiny model for which end id 43 ends some beams early (checked in the test).
CASES = [([45, 55, 40, 78], 43), ([53, 5, 33, 65, 62, 51, 38, 61, 45], 43)]
NEW = 10


def make_tiny_pair(base):
    """(HF model, bestiary engine) of the same tiny random LLaMA, under `base`."""
    hf_dir = make_tiny_llama(base, max_position_embeddings=256)
    convert(hf_dir, base / "ckpt", show_progress=False)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return hf, Engine.load(base / "ckpt")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("beam"))


def make_executor(engine, **limits) -> Executor:
    build = finalize_build_config(BuildConfig(**{"tokens_per_block": 4, **limits}), engine.config.model_dump())
    return Executor(engine.model, build)


def run_checked(ex: Executor, reqs) -> None:
    """Step to the end, checking the KV accounting after every step and the pool at the end."""
    while ex.has_work:
        ex.step()
        ex.check_kv_accounting()
    assert all(r.finished for r in reqs)
    ex.allocator.check_whole()


def hf_beams(hf, prompt, eos, length_penalty, early_stopping, new=NEW, num_return=4):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=num_return,
                          length_penalty=length_penalty, early_stopping=early_stopping, max_new_tokens=new,
                          do_sample=False, eos_token_id=eos, pad_token_id=PAD, output_scores=True,
                          return_dict_in_generate=True)
    return out.sequences[:, len(prompt):], out.sequences_scores


def our_beams(engine, prompt, eos, length_penalty, early_stopping, new=NEW):
    ex = make_executor(engine)
    req = ex.add(prompt, SamplingConfig(beam_width=4, length_penalty=length_penalty, early_stopping=early_stopping,
                                        max_new_tokens=new, end_id=eos))
    run_checked(ex, [req])
    return req


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_equals_hf_tiny(tiny, length_penalty, early_stopping):
    """All 4 returned beams and their scores equal HF's, with beams ending early on the end id."""
    hf, engine = tiny
    ended_early = False
    for prompt, eos in CASES:
        ref_ids, ref_scores = hf_beams(hf, prompt, eos, length_penalty, early_stopping)
        req = our_beams(engine, prompt, eos, length_penalty, early_stopping)
        hyps = req.search.results()
        ours = pad_outputs([[h.output_ids for h in hyps]], PAD)[0]
        assert torch.equal(ours, ref_ids[:, : ours.shape[1]]) and bool((ref_ids[:, ours.shape[1]:] == PAD).all())
        torch.testing.assert_close(torch.tensor([h.score for h in hyps]), ref_scores, atol=1e-5, rtol=0)
        assert req.output == hyps[0].output_ids
        assert all(h.logits == [] for h in hyps)  # raw logits are kept only when asked
        ended_early |= any(h.finish_reason == "stop" and len(h.output_ids) < NEW for h in hyps)
    assert ended_early, "no case exercised a beam finishing on the end id"


# Constructed log-probabilities (width 2, end id 0, 6 new tokens) on which the stopping rules
# disagree. Step 1 finishes [0]; step 2 finishes [1, 0] (both slots full) while [2, 4] runs on
# with log p ~ log 0.25; then [2, 4] meets a flat row and every other prefix continues with
# token 4 at p 0.999. Length penalty 1.0: True stops at the two short hypotheses, False and
# "never" go on to length 6. Length penalty 0.5: False stops (best running -1.39 / sqrt 2 is
# below the worst finished), "never" bounds with the longest length (-1.39 / sqrt 6) and goes on.
# Steps each rule takes (HF returns no step count; by hand from the script): True stops at step 2
# (both slots full); length penalty 1.0, False: [2, 4, ...] keeps beating the finished ones (the
# last steps add ~0) to the limit; 0.5, False: at step 3 its best -3.0 / sqrt 3 = -1.74 is below
# the worst finished (log .35 + log .6) / sqrt 2 = -1.1; "never" runs to the limit.
SCRIPT_STEPS = {(1.0, True): 2, (1.0, False): 6, (1.0, "never"): 6, (0.5, True): 2, (0.5, False): 3, (0.5, "never"): 6}
SCRIPT_VOCAB, SCRIPT_PROMPT, SCRIPT_NEW = 96, [5, 9, 12], 6
SCRIPT = {(): {0: 0.40, 1: 0.35, 2: 0.25}, (1,): {0: 0.6, 3: 0.4}, (2,): {4: 0.999},
          (2, 4): {5: 0.2, 6: 0.18, 7: 0.16, 3: 0.14, 1: 0.12, 2: 0.1}}


def scripted_logits(output: list[int], script: dict | None = None) -> torch.Tensor:
    """[V] logits of the next token after `output`: the script's probabilities (SCRIPT unless
    given), distinct tiny ones elsewhere."""
    logits = torch.log(1e-4 * (1 + 0.01 * torch.arange(SCRIPT_VOCAB, dtype=torch.float32)))
    for token, p in (SCRIPT if script is None else script).get(tuple(output), {4: 0.999}).items():
        logits[token] = float(torch.tensor(p).log())
    return logits


class ScriptedLogits(transformers.LogitsProcessor):
    """Replaces HF's log-probabilities by those of `scripted_logits` (the model's are ignored)."""

    def __init__(self, script: dict | None = None) -> None:
        self.script = script

    def __call__(self, input_ids, scores):
        rows = [scripted_logits(r[len(SCRIPT_PROMPT):].tolist(), self.script) for r in input_ids]
        return torch.log_softmax(torch.stack(rows), dim=-1)


def scripted_search(length_penalty, early_stopping, end_ids=frozenset({0}), script=None):
    """Our BeamSearch driven by the scripted logits: (hypotheses, scores) best first, steps taken."""
    cfg = SamplingConfig(beam_width=2, length_penalty=length_penalty, early_stopping=early_stopping,
                         max_new_tokens=SCRIPT_NEW, end_id=min(end_ids))
    search = BeamSearch(cfg, SCRIPT_PROMPT, set(end_ids), [], None, SCRIPT_NEW)
    search.step(scripted_logits([], script)[None], Beam(SCRIPT_PROMPT))
    steps = 1
    while not search.done:
        search.step(torch.stack([scripted_logits(b.output, script) for b in search.beams]))
        steps += 1
    return [h.output_ids for h in search.results()], [h.score for h in search.results()], steps


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_early_stopping_rules_on_constructed_logits(tiny, length_penalty):
    """Each early_stopping rule gives HF's hypotheses and scores where the rules disagree."""
    hf, _ = tiny
    ours = {}
    for early_stopping in (False, True, "never"):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([SCRIPT_PROMPT]), num_beams=2, num_return_sequences=2,
                              length_penalty=length_penalty, early_stopping=early_stopping,
                              max_new_tokens=SCRIPT_NEW, do_sample=False, eos_token_id=0, pad_token_id=PAD,
                              logits_processor=[ScriptedLogits()], output_scores=True,
                              return_dict_in_generate=True)
        ids, scores, steps = scripted_search(length_penalty, early_stopping)
        ref_ids, longest = ref.sequences[:, len(SCRIPT_PROMPT):], max(map(len, ids))
        assert steps == SCRIPT_STEPS[length_penalty, early_stopping]
        assert pad_outputs([ids], PAD)[0].tolist() == ref_ids[:, :longest].tolist()
        assert bool((ref_ids[:, longest:] == PAD).all())
        torch.testing.assert_close(torch.tensor(scores), ref.sequences_scores, atol=1e-6, rtol=0)
        ours[early_stopping] = ids
    if length_penalty == 1.0:  # the case tells True from False
        assert ours[True] == [[1, 0], [0]] and ours[False] == ours["never"] != ours[True]
    else:  # ... and "never" from False
        assert ours[False] == ours[True] == [[0], [1, 0]] and ours["never"][0] == [1, 3, 4, 4, 4, 4]


class RenormalisedBias(transformers.LogitsProcessor):
    """Our embedding_bias in HF's beam search: HF's processors see log-softmax scores, and
    log_softmax(lp + b) = log_softmax(x + b) is the bias added to the raw logits x, renormalised."""

    def __init__(self, bias: torch.Tensor) -> None:
        self.bias = bias

    def __call__(self, input_ids, scores):
        return torch.log_softmax(scores + self.bias, dim=-1)


def test_beam_search_with_processors_equals_hf_tiny(tiny):
    """Beams with embedding_bias, repetition penalty and min_length: HF's hypotheses and scores,
    and each hypothesis's per-token log probs and raw logits are HF's (via its beam indices)."""
    hf, engine = tiny
    bias = torch.zeros(96)
    bias[[7, 40, 55]] = torch.tensor([1.5, -2.0, 2.5])
    for prompt, eos in CASES:
        processors = [RenormalisedBias(bias), transformers.RepetitionPenaltyLogitsProcessor(1.5),
                      transformers.MinNewTokensLengthLogitsProcessor(len(prompt), 3, eos)]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, max_new_tokens=NEW,
                              do_sample=False, eos_token_id=eos, pad_token_id=PAD, logits_processor=processors,
                              output_scores=True, output_logits=True, return_dict_in_generate=True)
        ref_lp = hf.compute_transition_scores(ref.sequences, ref.scores, ref.beam_indices, normalize_logits=False)
        ex = make_executor(engine)
        req = ex.add(prompt, SamplingConfig(beam_width=4, max_new_tokens=NEW, end_id=eos, repetition_penalty=1.5,
                                            min_length=3, embedding_bias=bias.tolist(), output_log_probs=True,
                                            output_generation_logits=True))
        run_checked(ex, [req])
        hyps = req.search.results()
        ref_ids = ref.sequences[:, len(prompt):]
        for i, h in enumerate(hyps):
            n = len(h.output_ids)
            assert h.output_ids == ref_ids[i, :n].tolist() and bool((ref_ids[i, n:] == PAD).all())
            torch.testing.assert_close(torch.tensor(h.log_probs), ref_lp[i, :n], atol=1e-5, rtol=0)
            assert h.cum_log_prob == pytest.approx(sum(h.log_probs), abs=1e-4)
            rows = torch.stack([ref.logits[t][ref.beam_indices[i, t]] for t in range(n)])  # [n, V] raw
            torch.testing.assert_close(torch.stack(h.logits), rows, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor([h.score for h in hyps]), ref.sequences_scores, atol=1e-5, rtol=0)


def test_fork_block_tables_counts_what_the_pool_sees(tiny, monkeypatch):
    """The (allocated, released) fork_block_tables returns, which the executor moves between
    reservation and pool, are the pool's own change; some step forks two partial blocks."""
    _, engine = tiny
    seen = []

    def counted(allocator, kv, old, parents, children, block_size):
        before = allocator.num_used
        allocated, released = fork_block_tables(allocator, kv, old, parents, children, block_size)
        seen.append((allocated, released, allocator.num_used - before))
        return allocated, released

    monkeypatch.setattr(executor_module, "fork_block_tables", counted)
    ex = make_executor(engine)
    req = ex.add(list(range(1, 11)), SamplingConfig(beam_width=4, max_new_tokens=12, ignore_eos=True))
    run_checked(ex, [req])
    assert all(a - r == delta for a, r, delta in seen), seen
    assert max(a for a, _, _ in seen) >= 2 and max(r for _, r, _ in seen) >= 1, seen


# Three end ids: the first step's top 4 (= 2 * width) candidates hold three that end, so the
# second running beam comes from candidates 5 to 8 (K = (1 + end ids) * width, HF's rule);
# "never" lets [3, 4, ...] and [4, 4, ...] (log .15 / 6, log .1 / 6) overtake the finished [0], [1].
SCRIPT_3_ENDS = {(): {0: 0.3, 1: 0.25, 2: 0.2, 3: 0.15, 4: 0.1}}


def test_many_end_ids_keep_enough_candidates(tiny):
    """With 3 end ids HF keeps 4 * width candidates a step: same hypotheses and scores as HF."""
    hf, _ = tiny
    with torch.no_grad():
        ref = hf.generate(torch.tensor([SCRIPT_PROMPT]), num_beams=2, num_return_sequences=2,
                          max_new_tokens=SCRIPT_NEW, early_stopping="never", do_sample=False, eos_token_id=[0, 1, 2],
                          pad_token_id=PAD,
                          logits_processor=[ScriptedLogits(SCRIPT_3_ENDS)], output_scores=True,
                          return_dict_in_generate=True)
    ids, scores, _ = scripted_search(1.0, "never", frozenset({0, 1, 2}), SCRIPT_3_ENDS)
    ref_ids, longest = ref.sequences[:, len(SCRIPT_PROMPT):], max(map(len, ids))
    assert pad_outputs([ids], PAD)[0].tolist() == ref_ids[:, :longest].tolist()
    assert [4, 4] in [i[:2] for i in ids]  # the beam that needs the 5th candidate finishes
    torch.testing.assert_close(torch.tensor(scores), ref.sequences_scores, atol=1e-6, rtol=0)


def test_partial_block_must_be_copied_on_fork(tiny, monkeypatch):
    """Broken variant: children that share (instead of copy) the parent's partial block diverge from HF."""
    hf, engine = tiny
    prompt, eos = CASES[1]
    ref_ids, _ = hf_beams(hf, prompt, eos, 1.0, False, num_return=1)

    def share_everything(allocator, kv, old, parents, children, block_size):
        wanted, taken = set(parents), set()
        for i, seq in enumerate(old):
            if i not in wanted:
                allocator.free(seq.blocks)
        for child, p in zip(children, parents):
            if p in taken:
                allocator.share(old[p].blocks)
            taken.add(p)
            child.blocks = list(old[p].blocks)
        return 0, 0

    monkeypatch.setattr(executor_module, "fork_block_tables", share_everything)
    ex = make_executor(engine)
    req = ex.add(prompt, SamplingConfig(beam_width=4, max_new_tokens=NEW, end_id=eos))
    ex.run([req])
    assert req.output != ref_ids[0].tolist()[: len(req.output)]


def test_beams_in_flight_with_other_requests(tiny):
    """Beam and greedy requests arriving at different steps: each yields what it yields alone; pool whole."""
    _, engine = tiny
    rng = random.Random(1)
    work = [([rng.randrange(96) for _ in range(rng.randint(3, 30))], rng.choice([1, 3])) for _ in range(8)]

    def config(width):
        return SamplingConfig(beam_width=width, max_new_tokens=8, temperature=0.0, end_id=43)

    alone = []
    for prompt, width in work:
        ex = make_executor(engine)
        req = ex.add(prompt, config(width))
        run_checked(ex, [req])
        alone.append((req.output, [h.score for h in req.search.results()] if req.search else None))
    ex = make_executor(engine, max_batch_size=3, max_num_tokens=20)
    reqs, pending = [], list(work)
    while pending or ex.has_work:
        if pending and rng.random() < 0.5:
            prompt, width = pending.pop(0)
            reqs.append(ex.add(prompt, config(width)))
        ex.step()
        ex.check_kv_accounting()
    ex.allocator.check_whole()
    for req, (output, scores) in zip(reqs, alone):
        assert req.output == output
        if scores is not None:
            torch.testing.assert_close(torch.tensor([h.score for h in req.search.results()]), torch.tensor(scores))


def test_beam_requests_reuse_a_shared_prompt(tiny):
    """A second beam request with the same 20-token prompt reuses its full blocks; same beams."""
    _, engine = tiny
    prompt = list(range(3, 23))
    ex = make_executor(engine)
    first = ex.add(prompt, SamplingConfig(beam_width=3, max_new_tokens=6, ignore_eos=True))
    run_checked(ex, [first])
    second = ex.add(prompt, SamplingConfig(beam_width=3, max_new_tokens=6, ignore_eos=True))
    run_checked(ex, [second])
    assert ex.allocator.stats.hit_blocks == (len(prompt) - 1) // 4
    assert second.output == first.output
    assert [h.score for h in second.search.results()] == [h.score for h in first.search.results()]


def test_cancel_mid_beam_search_returns_blocks(tiny):
    _, engine = tiny
    ex = make_executor(engine)
    req = ex.add(list(range(1, 11)), SamplingConfig(beam_width=4, max_new_tokens=30, ignore_eos=True))
    for _ in range(4):
        ex.step()
    assert len(req.search.beams) == 4 and all(b.blocks for b in req.search.beams)
    assert all(b.logits == [] for b in req.search.beams)  # no [V] row a step kept unless asked
    ex.cancel(req)
    ex.allocator.check_whole()
    unstarted = ex.add(list(range(1, 11)), SamplingConfig(beam_width=4, max_new_tokens=30, ignore_eos=True))
    ex.cancel(unstarted)  # before its first step: no beams yet
    ex.allocator.check_whole()


def test_stop_words_end_beams(tiny):
    """A 2-token stop word taken from the unconstrained best beam ends the beams that produce it."""
    _, engine = tiny
    prompt = [7, 3, 19, 54]
    free = our_beams(engine, prompt, None, 1.0, False)
    word = free.output[2:4]
    ex = make_executor(engine)
    req = ex.add(prompt, SamplingConfig(beam_width=4, max_new_tokens=NEW, ignore_eos=True, stop_words=[word]))
    run_checked(ex, [req])
    hyps = req.search.results()
    assert any(h.finish_reason == "stop" for h in hyps)
    for h in hyps:
        ids = h.output_ids
        first_end = next(i + 2 for i in range(len(ids) - 1) if ids[i : i + 2] == word) if h.finish_reason == "stop" else None
        assert (first_end == len(ids)) if h.finish_reason == "stop" else (h.finish_reason == "length" and len(ids) == NEW)
    # min_length 4: the word ending at the 4th token still ends beams there (min_length counts it)
    ex = make_executor(engine)
    late = ex.add(prompt, SamplingConfig(beam_width=4, max_new_tokens=NEW, ignore_eos=True, stop_words=[word],
                                         min_length=4))
    run_checked(ex, [late])
    stopped = [len(h.output_ids) for h in late.search.results() if h.finish_reason == "stop"]
    assert 4 in stopped and min(stopped) >= 4, stopped


def test_diversity_rate_spreads_parents():
    """Rate 0 keeps HF's choice (all from the dominant beam); a large rate takes each beam's best."""
    cfg = SamplingConfig(beam_width=4, max_new_tokens=5, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    first = 0.1 * torch.randn(1, 32, generator=gen)
    first[0, :4] += 10.0  # four near-equal beams
    second = 0.1 * torch.randn(4, 32, generator=gen)  # flat rows: log p ~ -log 32 ...
    second[0, 4:8] += 10.0  # ... but beam 0 has four likely continuations (log p ~ -log 4)

    def parents(rate):
        search = BeamSearch(cfg.model_copy(update={"beam_search_diversity_rate": rate}), [1, 2], set(), [], None, 5)
        search.step(first, Beam([1, 2]))
        return search.step(second), search

    plain, _ = parents(0.0)
    assert plain == [0, 0, 0, 0]
    # rate 1: each beam's k-th best candidate is ranked at acc - k (a reference written out here)
    mild, search = parents(1.0)
    beam_scores = torch.log_softmax(first, dim=-1)[0].topk(4).values  # [4] the beams after step 1, best first
    acc = torch.log_softmax(second, dim=-1) + beam_scores[:, None]  # [4, 32]
    ranked = [(float(a) - k, beam) for beam in range(4) for k, a in enumerate(acc[beam].sort(descending=True).values)]
    assert mild == [beam for _, beam in sorted(ranked, reverse=True)[:4]] and mild != plain
    diverse, search = parents(100.0)
    assert sorted(diverse) == [0, 1, 2, 3]
    lp = torch.log_softmax(second, dim=-1)
    assert [b.output[-1] for b in search.beams] == [int(lp[p].argmax()) for p in diverse]


# --- the real model ---------------------------------------------------------------------------
# hf_model and hf_tokenizer: session fixtures of tests/conftest.py (shared with tests/models/test_smollm2.py)


@pytest.fixture(scope="module")
def engine_dir(smollm2_fp32_engine):
    """test_smollm2's fp32 engine (BuildConfig(max_batch_size=4, max_seq_len=512)): tests/conftest.py."""
    return smollm2_fp32_engine


CHAT = "<|im_start|>user\nWhat is 2+2? Answer with a number.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_beam_search_equals_hf_smollm2(engine_dir, hf_model, hf_tokenizer):
    """SmolLM2 fp32, 4 beams, 16 new tokens: HF's best sequence, and its score within 1e-4."""
    from bestiary.core.runtime.llm import LLM

    ids = hf_tokenizer(CHAT).input_ids
    eos = hf_model.generation_config.eos_token_id
    llm = LLM(engine_dir)
    for length_penalty in (1.0, 0.5):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), num_beams=4, length_penalty=length_penalty,
                                    early_stopping=False, max_new_tokens=16, do_sample=False, output_scores=True,
                                    return_dict_in_generate=True)
        (ours,) = llm.generate([ids], SamplingConfig(beam_width=4, length_penalty=length_penalty,
                                                     max_new_tokens=16, end_id=eos))
        assert ours.output_ids == ref.sequences[0, len(ids):].tolist()
        diff = abs(ours.beams[0].score - ref.sequences_scores[0].item())
        print(f"\nSmolLM2 beams 4, length_penalty {length_penalty}: sequences equal, |score diff| {diff:.2e}")
        assert diff <= 1e-4
        assert ours.finish_reason == "stop"
        llm.executor.allocator.check_whole()
