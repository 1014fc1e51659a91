"""Speculative decoding (core.runtime.speculative): prompt lookup and a draft engine, verified in one
step of the in-flight batch with KV rollback. Greedy output equals plain decoding token for token
(fp32 and bf16, batch 1 and a mixed batch); sampled output keeps plain sampling's distribution."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")
scipy_stats = pytest.importorskip("scipy.stats")

from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.build_config import BuildConfig, finalize_build_config
from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.executor import Executor
from bestiary.core.runtime.sampling import SamplingConfig, make_generator
from bestiary.core.runtime.speculative import (
    AcceptanceStats,
    SpeculativeConfig,
    accept_drafts,
    ngram_draft,
    speculative_config,
    target_probs,
)

GREEDY = {"temperature": 0.0, "ignore_eos": True}
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Checkpoint dirs: the tiny LLaMA in fp32 and bf16, and a second tiny LLaMA (another seed, same vocab)."""
    base = tmp_path_factory.mktemp("spec")
    hf = make_tiny_llama(base / "a", max_position_embeddings=256)
    other = make_tiny_llama(base / "b", seed=7, max_position_embeddings=256)
    out = {dtype: convert(hf, base / dtype, ConvertOptions(dtype=dtype), show_progress=False) for dtype in DTYPES}
    out["other"] = convert(other, base / "other", ConvertOptions(dtype="float32"), show_progress=False)
    return out


@pytest.fixture(scope="module")
def engines(dirs):
    return {dtype: Engine.load(dirs[dtype]) for dtype in DTYPES}


def make_executor(engine, spec: SpeculativeConfig | None = None, **limits) -> Executor:
    build = finalize_build_config(BuildConfig(tokens_per_block=4, **limits), engine.config.model_dump())
    return Executor(engine.model, build, speculative=spec)


def methods(dirs, dtype: str) -> dict[str, SpeculativeConfig]:
    """Prompt lookup, and a draft engine: the same weights in the other dtype (accepts most drafts,
    not all) and an unrelated model (rejects most). A fixed k (adaptive off): every step drafts, so
    verification and rollback run on every step (the adaptive k has its own tests below)."""
    other_dtype = DTYPES[1 - DTYPES.index(dtype)]
    return {
        "ngram": SpeculativeConfig(method="ngram", num_draft_tokens=5, adaptive=False),
        "draft": SpeculativeConfig(method="draft", num_draft_tokens=3, draft_engine_dir=str(dirs[other_dtype]),
                                   adaptive=False),
        "draft-other": SpeculativeConfig(method="draft", num_draft_tokens=4, draft_engine_dir=str(dirs["other"]),
                                         adaptive=False),
    }


def prompts_20(seed: int = 0) -> list[list[int]]:
    """20 prompts of 3..40 tokens, half of them with a repeated phrase (prompt lookup finds it)."""
    rng = random.Random(seed)
    out = []
    for i in range(20):
        p = [rng.randrange(96) for _ in range(rng.randint(3, 24))]
        if i % 2:
            p += p[: rng.randint(2, 8)] + p[: rng.randint(2, 8)]
        out.append(p)
    return out


def run_all(ex: Executor, work: list[tuple[list[int], SamplingConfig]]) -> list:
    """Add every request at once and step to the end, checking the KV accounting after each step."""
    reqs = [ex.add(p, s) for p, s in work]
    while ex.has_work:
        ex.step()
        ex.check_kv_accounting()
    ex.allocator.check_whole()
    return reqs


def one_by_one(ex: Executor, work) -> list:
    return [run_all(ex, [w])[0] for w in work]


BATCH_1 = [(p, SamplingConfig(max_new_tokens=12, **GREEDY)) for p in prompts_20()]


@pytest.fixture(scope="module")
def plain_batch_1(engines):
    """Plain greedy outputs of BATCH_1, one request at a time, per dtype."""
    return {d: [r.output for r in one_by_one(make_executor(engines[d], max_batch_size=1), BATCH_1)] for d in DTYPES}


# --- the drafters and the acceptance rule ---------------------------------------------------
def test_ngram_draft_takes_the_latest_longest_match():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], k=2) == [7, 5]  # latest of the 3-gram
    assert ngram_draft([4, 1, 2, 8, 3, 2, 6, 1, 2], k=3) == [8, 3, 2]  # the 2-gram beats the later 1-gram
    assert ngram_draft([5, 6, 7, 8], k=4) == []
    assert ngram_draft([1, 2, 1, 2], k=5, ngram_max=2) == [1, 2]  # cut at the end of the sequence
    assert ngram_draft([1, 2, 9, 1], k=3, ngram_max=3, ngram_min=2) == []  # 1-grams off


def test_accept_drafts_greedy_stops_at_the_first_mismatch():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 9, 2]):
        logits[row, best] = 5.0
    greedy, gen = SamplingConfig(temperature=0.0), make_generator(0)
    assert accept_drafts(logits, [3, 4, 1], greedy, gen) == [3, 4, 9]  # correction at draft 3
    assert accept_drafts(logits, [3, 4, 9], greedy, gen) == [3, 4, 9, 2]  # all accepted + bonus
    assert accept_drafts(logits, [0, 4, 9], greedy, gen) == [3]


def chi_square_p(a: list[int], b: list[int], min_expected: float = 5.0) -> float:
    """p-value of a chi-square test that samples a and b come from one distribution (rare values pooled)."""
    values = sorted(set(a) | set(b))
    ca, cb = [a.count(v) for v in values], [b.count(v) for v in values]
    keep = [i for i in range(len(values)) if ca[i] + cb[i] >= 2 * min_expected]
    table = [[ca[i] for i in keep], [cb[i] for i in keep]]
    rest = (len(a) - sum(table[0]), len(b) - sum(table[1]))
    if rest[0] + rest[1] > 0:
        table[0].append(rest[0])
        table[1].append(rest[1])
    return float(scipy_stats.chi2_contingency(table).pvalue)


def fit_p(samples: list[int], probs: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test of `samples` against the distribution probs [V]."""
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep].double() / probs[keep].double().sum() * len(samples)
    return float(scipy_stats.chisquare(counts[keep].numpy(), expected.numpy()).pvalue)


def test_acceptance_rule_keeps_the_target_distribution():
    """2,000 draws of the rule's first emitted token against the target's exact p_0, and of the
    token after an accepted first draft against p_1 (chi-square goodness of fit)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 12) * 1.5  # [k + 1, V]
    s = SamplingConfig(temperature=0.8, top_k=8)
    probs = target_probs(logits, s)
    draft = [int(probs[0].argsort()[-2]), int(probs[1].argmax())]  # a plausible but not certain draft
    gen = make_generator(1)
    firsts, seconds = [], []
    for _ in range(2000):
        out = accept_drafts(logits, draft, s, gen)
        firsts.append(out[0])
        if out[0] == draft[0]:
            seconds.append(out[1])
    assert fit_p(firsts, probs[0]) > 0.01
    assert fit_p(seconds, probs[1]) > 0.01
    # the test has power: always accepting the first draft would be far off
    assert fit_p([draft[0]] * 1000 + firsts[:1000], probs[0]) < 1e-6


# --- greedy: identical to plain decoding ------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_batch_1_identical(engines, dirs, plain_batch_1, dtype, method):
    """20 prompts one at a time: every output token equals plain greedy decoding; drafts were both
    accepted and rejected (so rollback ran)."""
    ex = make_executor(engines[dtype], methods(dirs, dtype)[method], max_batch_size=1)
    spec = one_by_one(ex, BATCH_1)
    assert [r.output for r in spec] == plain_batch_1[dtype]
    total = ex.speculator.stats
    assert 0 < total.accepted < total.drafted
    assert sum(r.spec.drafted for r in spec) == total.drafted


@pytest.mark.parametrize(("dtype", "method"), [(d, m) for d in DTYPES for m in ("ngram", "draft")]
                         + [("float32", "draft-other")])
def test_greedy_mixed_batch_identical(engines, dirs, dtype, method):
    """20 requests in one batch (lengths, output lengths, end ids, log-prob and sampled requests
    mixed in): the greedy ones equal plain decoding, per-request statistics add up."""
    rng = random.Random(1)
    work = []
    for i, p in enumerate(prompts_20(2)):
        kind = i % 5
        s = SamplingConfig(max_new_tokens=rng.randint(4, 30), temperature=0.0, ignore_eos=kind != 1,
                           end_id=p[-1] if kind == 1 else None, output_log_probs=kind == 2)
        if kind == 3:
            s = SamplingConfig(max_new_tokens=20, temperature=0.9, random_seed=i, ignore_eos=True)
        work.append((p, s))
    plain = run_all(make_executor(engines[dtype], max_batch_size=20), work)
    ex = make_executor(engines[dtype], methods(dirs, dtype)[method], max_batch_size=20)
    spec = run_all(ex, work)
    for (_, s), a, b in zip(work, spec, plain):
        if s.is_greedy:
            assert a.output == b.output and a.finish_reason == b.finish_reason
        else:
            assert len(a.output) == len(b.output)
    assert all(r.spec.drafted == 0 for (_, s), r in zip(work, spec) if s.output_log_probs)  # chooser: plain
    assert ex.speculator.stats.accepted > 0


def test_greedy_with_arrivals_and_chunked_prefill_fp32(engines, dirs):
    """Requests arriving over time with a small token budget (chunked prefill beside verification)."""
    rng = random.Random(3)
    work = [(p, SamplingConfig(max_new_tokens=rng.randint(2, 20), **GREEDY)) for p in prompts_20(4)]
    for spec in (None, methods(dirs, "float32")["ngram"]):
        ex = make_executor(engines["float32"], spec, max_batch_size=4, max_num_tokens=12)
        reqs, pending = [], list(work)
        while pending or ex.has_work:
            if pending and rng.random() < 0.5:
                reqs.append(ex.add(*pending.pop(0)))
            ex.step()
            ex.check_kv_accounting()
        ex.allocator.check_whole()
        outputs = [r.output for r in reqs]
        if spec is None:
            expected = outputs
    assert outputs == expected
    assert ex.speculator.stats.accepted > 0


# --- sampled: plain sampling's distribution ---------------------------------------------------
def test_sampled_tokens_match_plain_sampling(engines, dirs):
    """5,000 seeded samples of a tiny model's first three tokens, through the executor with an
    unrelated draft model (mostly rejected: the residual path) vs plain sampling: chi-square per position.
    Token 1 comes from the prompt step, token 2 from a verification, token 3 is its bonus or the next step's."""
    prompt = [5, 17, 33, 5, 17, 40, 2]

    def s(i: int, seed0: int) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=3, temperature=1.0, top_k=12, random_seed=seed0 + i, ignore_eos=True)

    spec = SpeculativeConfig(method="draft", num_draft_tokens=2, draft_engine_dir=str(dirs["other"]),
                             max_verify_rows=1000, adaptive=False)
    samples = {}
    for name, config, seed0 in (("plain", None, 0), ("spec", spec, 100_000)):
        ex = make_executor(engines["float32"], config, max_batch_size=500, max_num_tokens=4000)
        outs = []
        for wave in range(10):  # waves of 500: after the prompt step, every step is all-decode
            reqs = [ex.add(prompt, s(wave * 500 + i, seed0)) for i in range(500)]
            ex.run(reqs)
            outs += [r.output for r in reqs]
        samples[name] = outs
        if config is not None:
            assert ex.speculator.stats.drafted >= 4000 and ex.speculator.stats.accepted > 0
    for pos in range(3):
        a = [o[pos] for o in samples["spec"]]
        b = [o[pos] for o in samples["plain"]]
        assert chi_square_p(a, b) > 0.01, pos


# --- API ----------------------------------------------------------------------------------------
def test_config_errors_are_one_line(dirs):
    with pytest.raises(BestiaryError, match="draft_engine_dir"):
        speculative_config({"method": "draft"})
    with pytest.raises(BestiaryError, match="method"):
        speculative_config({"method": "medusa"})
    with pytest.raises(BestiaryError, match="num_draft_tokens"):
        speculative_config({"method": "ngram", "num_draft_tokens": 0})
    assert speculative_config(None) is None
    assert speculative_config({"method": "ngram"}).num_draft_tokens == 4


def test_draft_engine_with_another_vocabulary_is_refused(engines, tmp_path):
    small = convert(make_tiny_llama(tmp_path, vocab_size=64), tmp_path / "small", show_progress=False)
    spec = SpeculativeConfig(method="draft", draft_engine_dir=str(small))
    with pytest.raises(BestiaryError, match="vocab_size 64, expected the target's 96"):
        make_executor(engines["float32"], spec)


def replay_ngram(prompt: list[int], output: list[int], k: int) -> AcceptanceStats:
    """The counts greedy prompt lookup must report for a batch-1 request whose plain output is
    `output`: after the prompt step, each step drafts ngram_draft(tokens, k') (k' = k cut to the
    length left), accepts the drafts that equal the next output tokens and emits them plus one."""
    stats, done, max_len = AcceptanceStats(), 1, len(prompt) + len(output)  # token 1: the prompt step
    while done < len(output):
        tokens = prompt + output[:done]
        draft = ngram_draft(tokens, min(k, max_len - len(tokens) - 1))
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[done + accepted]:
            accepted += 1
        if draft:
            stats.add(AcceptanceStats(1, len(draft), accepted))
        done += accepted + 1
    return stats


def test_llm_reports_acceptance(dirs):
    """Repetitive prompts, where prompt lookup must find drafts: Completion.speculative holds exactly
    the steps, drafted and accepted counts that replaying the drafter over the plain output gives."""
    from bestiary.core.runtime.llm import LLM

    llm = LLM(dirs["float32"], speculative={"method": "ngram", "num_draft_tokens": 4, "adaptive": False})
    plain_llm = LLM(dirs["float32"])
    sampling = SamplingConfig(max_new_tokens=20, **GREEDY)
    total = AcceptanceStats()
    for prompt in ([5, 6, 7, 8, 9] * 4, list(range(10, 20)) * 3, prompts_20()[1]):
        done = llm.generate([prompt], sampling)[0]
        plain = plain_llm.generate([prompt], sampling)[0]
        assert plain.output_ids == done.output_ids and plain.speculative is None
        s = done.speculative
        assert isinstance(s, AcceptanceStats)
        assert s == replay_ngram(prompt, done.output_ids, 4)
        assert s.steps > 0 and 0 <= s.accepted <= s.drafted <= 4 * s.steps
        assert s.acceptance_rate == s.accepted / s.drafted
        assert s.tokens_per_step == (s.accepted + s.steps) / s.steps
        assert s.accepted + s.steps <= len(done.output_ids) - 1  # the first token comes from the prompt step
        total.add(s)
    assert total.accepted > 0 and total.drafted > total.accepted  # drafts both accepted and rejected
    assert llm.executor.speculator.stats == total


def test_cli_run_flags(dirs, capsys):
    from bestiary.core.cli.main import main

    base = ["run", "--engine_dir", str(dirs["float32"]), "--input_ids", ",".join(map(str, prompts_20()[1])),
            "--max_output_len", "12"]
    assert main(base + ["--num_draft_tokens", "3"]) == 2
    assert "--num_draft_tokens needs --speculative ngram|draft" in capsys.readouterr().err
    assert main(base + ["--fixed_draft_tokens"]) == 2
    assert "--fixed_draft_tokens needs --speculative ngram|draft" in capsys.readouterr().err
    assert main(base + ["--speculative", "draft"]) == 2
    assert "--speculative: method draft needs draft_engine_dir" in capsys.readouterr().err
    assert main(base) == 0
    plain = capsys.readouterr().out
    for fixed in ([], ["--fixed_draft_tokens"]):
        assert main(base + ["--speculative", "ngram", "--num_draft_tokens", "3", *fixed]) == 0
        out = capsys.readouterr()
        assert out.out == plain
        assert "[bestiary] input 0: ngram accepted " in out.err and "tokens per verification step" in out.err


def test_fixed_draft_tokens_flag_turns_the_adaptive_k_off():
    import argparse

    from bestiary.core.cli.speculative_flags import add_speculative_flags, speculative_from_args

    parser = argparse.ArgumentParser()
    add_speculative_flags(parser)
    assert speculative_from_args(parser.parse_args(["--speculative", "ngram"])).adaptive
    fixed = speculative_from_args(parser.parse_args(["--speculative", "ngram", "--fixed_draft_tokens"]))
    assert not fixed.adaptive and fixed.num_draft_tokens == 4
    with pytest.raises(BestiaryError, match="probe_interval"):
        speculative_config({"method": "ngram", "probe_interval": 0})


def test_serve_metrics_count_drafts(engines, dirs):
    pytest.importorskip("prometheus_client")
    from bestiary.core.serve.metrics import ServerMetrics

    ex = make_executor(engines["float32"], methods(dirs, "float32")["ngram"])
    metrics = ServerMetrics(ex)
    run_all(ex, [(prompts_20()[1], SamplingConfig(max_new_tokens=16, **GREEDY))])
    text = metrics.exposition().decode()
    stats = ex.speculator.stats
    assert stats.drafted > 0
    assert f"bestiary_spec_decode_draft_tokens_total {float(stats.drafted)}" in text
    assert f"bestiary_spec_decode_accepted_tokens_total {float(stats.accepted)}" in text


# --- SmolLM2-135M-Instruct (slow) -----------------------------------------------------------
SMOL_PROMPTS = [
    "Rewrite: The quick brown fox jumps over the lazy dog. The dog does not move.",
    "Repeat this list: apples, pears, plums, cherries, apples, pears, plums.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nRename it to fib:",
    "Summarize: Paris is the capital of France. It is known for the Eiffel Tower.",
    "What is the capital of France?", "Count from one to ten in words.", "Write a haiku about rain.",
    "Translate to French: good morning, my friend.", "List three primary colors.", "What is 12 times 12?",
    "Give a synonym for happy.", "Name the largest planet.", "Spell the word necessary.",
    "Correct the typos: Teh cat sat on teh mat and teh dog sat on teh rug.",
    "Copy exactly: one two three four five six seven eight nine ten.",
    "Explain what a noun is in one sentence.", "Say hello in Spanish.", "Write the alphabet.",
    "What color is the sky on a clear day?", "Reverse the words: red green blue yellow.",
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_gguf, smollm2_fp32_checkpoint):
    """SmolLM2 checkpoints in bf16 and fp32 (each drafts for the other; fp32: the session's,
    tests/conftest.py) and the prompts' chat ids."""
    from bestiary.core.runtime.llm import LLM

    base = tmp_path_factory.mktemp("spec_smol")
    out = {"float32": smollm2_fp32_checkpoint,
           "bfloat16": convert(smollm2_gguf, base / "bfloat16", ConvertOptions(dtype="bfloat16"), show_progress=False)}
    llm = LLM(out["float32"])
    out["prompts"] = [llm.chat_ids([{"role": "user", "content": p}]) for p in SMOL_PROMPTS]
    out["engines"] = {d: Engine.load(out[d]) for d in DTYPES}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_greedy_identical(smol, dtype):
    """20 chat prompts: batch 1 (bf16) and one mixed batch (both dtypes), prompt lookup and a draft engine
    (the model in the other dtype), 32 new tokens: every token equals plain greedy decoding."""
    work = [(p, SamplingConfig(max_new_tokens=32, temperature=0.0)) for p in smol["prompts"]]
    engine = smol["engines"][dtype]
    other = str(smol[DTYPES[1 - DTYPES.index(dtype)]])
    specs = [SpeculativeConfig(method="ngram", num_draft_tokens=6, adaptive=False),
             SpeculativeConfig(method="ngram", num_draft_tokens=6),
             SpeculativeConfig(method="draft", num_draft_tokens=4, draft_engine_dir=other, adaptive=False)]
    plain = [r.output for r in run_all(make_executor(engine, max_batch_size=20, max_seq_len=512), work)]
    if dtype == "bfloat16":
        plain_1 = [r.output for r in one_by_one(make_executor(engine, max_batch_size=1, max_seq_len=512), work)]
    for spec in specs:
        ex = make_executor(engine, spec, max_batch_size=20, max_seq_len=512)
        assert [r.output for r in run_all(ex, work)] == plain, spec.method
        assert ex.speculator.stats.accepted > 0
        if dtype == "bfloat16":
            ex = make_executor(engine, spec, max_batch_size=1, max_seq_len=512)
            assert [r.output for r in one_by_one(ex, work)] == plain_1, spec.method


# --- the adaptive k (core.runtime.speculative_adaptive) ---------------------------------------
def fake_costs(ak, plain: float = 1.0, per_row: float = 0.05, draft: float = 0.0) -> None:
    """Deterministic costs: F(R) = plain (1 + per_row (R - 1)) for R = 1..9, d = draft."""
    for rows in range(1, 10):
        ak.costs.add_step(rows, plain * (1 + per_row * (rows - 1)))
    ak.costs.add_draft(draft)


def test_expected_tokens_and_step_costs():
    from bestiary.core.runtime.speculative_adaptive import AdaptiveK, StepCosts, expected_tokens

    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    costs = StepCosts()
    costs.add_step(1, 2.0)
    assert costs.step(3) == pytest.approx(2.0 * (1 + 2 * 0.05))  # one row count: the prior slope
    costs.add_step(5, 3.0)
    assert costs.step(3) == pytest.approx(2.5) and costs.step(9) == pytest.approx(4.0)  # interpolated, extrapolated
    costs.add_step(1, 100.0)  # an outlier moves the EMA by at most 2x the old value's share
    assert costs.step(1) == pytest.approx(0.8 * 2.0 + 0.2 * 4.0)
    ak = AdaptiveK(max_k=4)
    fake_costs(ak, per_row=0.05, draft=0.1)
    # speedup(k) = E(k) F(1) / (F(1 + k) + k d): a = 0.9 pays for k = 4; a = 0.1 does not pay for any k
    assert ak.best_k(0.9, 1, 4) == 4 and ak.best_k(0.1, 1, 4) == 0
    assert ak.best_k(0.9, 1, 2) == 2  # capped (length left, verification budget)
    # the rate of a batch: B - 1 + E(k) tokens in F(B + k) + k d
    assert ak.costs.rate(3, 2, 0.5) == pytest.approx((2 + 1.75) / (1.2 + 0.2))


def test_adaptive_k_goes_to_zero_when_drafts_never_accept_and_returns_when_they_do():
    """Fake costs (verification rows cheap, drafts free): a sequence whose drafts are never accepted
    drops to k = 0 and re-probes with K drafts after 5 plain steps, then 10, 20, 40, 40 (each failed
    probe doubles the wait, up to 8x); once a probe's drafts are accepted, k goes back up to K and stays."""
    from bestiary.core.runtime.speculative_adaptive import AdaptiveK

    ak = AdaptiveK(max_k=4, probe_interval=5)
    fake_costs(ak)
    ks = []
    for _ in range(200):
        k = ak.choose("seq", 1, 4)
        ks.append(k)
        ak.observe("seq", k, 0)  # every draft rejected
    assert ks[0] == 3 and 0 in ks[:10]  # a = 0.5 (the prior): E(3) / F(4) = 1.875 / 1.15 is the best
    first_zero = ks.index(0)
    probes = [i for i, k in enumerate(ks) if k and i > first_zero]
    assert all(ks[i] == 4 for i in probes)
    assert [b - a for a, b in zip(probes, probes[1:])][:5] == [11, 21, 41, 41, 41]  # after the first: 6
    assert ak.probes == len(probes) and ak.acceptance("seq") < 0.05
    back = []
    for _ in range(60):
        k = ak.choose("seq", 1, 4)
        back.append(k)
        ak.observe("seq", k, k)  # every draft accepted
    first = next(i for i, k in enumerate(back) if k)
    assert first <= 41 and all(k == 4 for k in back[first + 3 :]), back
    assert ak.acceptance("seq") > 0.5 and ak.seqs["seq"].failed_probes == 0
    ak.forget(set())
    assert not ak.seqs and ak.acceptance("seq") > 0.1  # a new sequence starts from the running average


class FakeClock:
    """time.perf_counter for the speculator: every call advances by `tick` seconds (deterministic costs)."""

    def __init__(self, tick: float = 1.0) -> None:
        self.now, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


@pytest.mark.parametrize("method", ["ngram", "draft", "draft-other"])
def test_adaptive_greedy_identical(engines, dirs, plain_batch_1, monkeypatch, method):
    """Adaptive k on (deterministic costs: a fake clock): every output equals plain greedy decoding,
    batch 1, both drafters; k goes to 0 where drafts are rejected (an unrelated draft model) and stays
    above 0 where they are accepted (prompt lookup on repeated phrases, the same weights in bf16)."""
    from bestiary.core.runtime import speculative

    monkeypatch.setattr(speculative, "time", FakeClock())
    spec = methods(dirs, "float32")[method].model_copy(update={"adaptive": True, "probe_interval": 4})
    ex = make_executor(engines["float32"], spec, max_batch_size=1)
    assert [r.output for r in one_by_one(ex, BATCH_1)] == plain_batch_1["float32"]
    choices = ex.speculator.adaptive.choices
    assert ex.speculator.stats.drafted > 0 and sum(choices.values()) > 40
    if method == "draft-other":
        assert choices.get(0, 0) > sum(n for k, n in choices.items() if k) and ex.speculator.adaptive.probes > 0
    else:
        assert ex.speculator.stats.accepted > 0 and sum(n for k, n in choices.items() if k) > 0
