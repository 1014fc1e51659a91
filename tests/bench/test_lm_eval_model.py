"""bestiary as an lm-eval model on a tiny random LLaMA (fast): loglikelihood, loglikelihood_rolling and
generate_until against HF transformers on the same weights; each shared context computed once (its
continuations fork it: core.bench.loglikelihood), equal to standalone scoring; the `bestiary lm-eval` command. The real-model parity
with lm-eval's own `hf` model is tests/bench/test_lm_eval_smollm2.py (slow)."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("lm_eval") is None:  # not importorskip: lm-eval is imported through lm_eval_compat
    pytest.skip("lm-eval is not installed (the eval extra)", allow_module_level=True)
import torch  # noqa: E402
import transformers  # noqa: E402

import bestiary.core.bench.lm_eval_compat  # noqa: E402,F401 - lm-eval under transformers 5

CONTEXTS = ["The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with",
            "Hello world! How are you", "The capital of France is"]
CONTINUATIONS = [" one step.", " Paris", " today? I am fine, thank you.", " 1 2 3", "!"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_chat import make_tiny_chat_engine

    base = tmp_path_factory.mktemp("lm_eval_tiny")
    make_tiny_chat_engine(base, max_batch_size=4, max_seq_len=256)  # tokens_per_block 8: contexts span blocks
    tok = transformers.AutoTokenizer.from_pretrained(base / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(base / "hf", dtype=torch.float32).eval()
    return base, tok, model


@pytest.fixture(scope="module")
def lm(tiny):
    from bestiary.core.bench.lm_eval_model import BestiaryLM

    return BestiaryLM(engine_dir=str(tiny[0] / "engine"))


def _instances(kind: str, args: list[tuple]) -> list:
    from bestiary.core.bench.lm_eval_compat import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _hf_score(tok, model, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's `hf` on one pair: ids of context and of the whole, the continuation's log probs."""
    ctx = tok(context, add_special_tokens=False).input_ids
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    cont = torch.tensor(whole[len(ctx):])
    with torch.no_grad():
        logp = model(torch.tensor([whole[:-1]])).logits[0].log_softmax(-1)[-len(cont):]  # [n, V]
    return float(logp.gather(1, cont[:, None]).sum()), bool((logp.argmax(-1) == cont).all())


def _computed_tokens(executor, monkeypatch) -> list[int]:
    """The tokens each step of `executor` computes, recorded as it runs."""
    counts: list[int] = []
    schedule = executor._schedule
    monkeypatch.setattr(executor, "_schedule", lambda: (lambda w: counts.append(sum(n for *_, n in w)) or w)(schedule()))
    return counts


def test_loglikelihood_matches_transformers_and_computes_each_context_once(tiny, lm, monkeypatch):
    """Every pair as transformers scores it; each context computed once (less what earlier contexts left
    cached), each distinct continuation only past its context, one-token continuations not at all."""
    pairs = [(c, k) for c in CONTEXTS for k in CONTINUATIONS[:3] + CONTINUATIONS[4:]]  # 3 followers per context
    requests = _instances("loglikelihood", pairs)
    encoded = [lm._encode_pair(c, k) for c, k in pairs]
    lengths = [len(lm.tok_encode(c)) for c in CONTEXTS]
    assert any(n > 8 and n % 8 for n in lengths), "a context must end in a partial block (tokens_per_block 8)"
    executor = lm.llm.executor
    counts, hits = _computed_tokens(executor, monkeypatch), executor.allocator.stats.hit_tokens
    got = lm.loglikelihood(requests)
    for (c, k), (logp, greedy) in zip(pairs, got):
        ref = _hf_score(tiny[1], tiny[2], c, k)
        assert logp == pytest.approx(ref[0], abs=1e-4) and greedy == ref[1], (c, k)
    contexts = {tuple(ctx) for ctx, _ in encoded}
    suffixes = {(tuple(ctx), tuple(cont[:-1])) for ctx, cont in encoded}
    reused = executor.allocator.stats.hit_tokens - hits
    assert sum(counts) + reused == sum(map(len, contexts)) + sum(len(s) for _, s in suffixes)
    assert sum(counts) < sum(len(ctx) + len(cont) - 1 for ctx, cont in encoded) / 2


def test_shared_context_scoring_equals_standalone_requests(tiny, lm, monkeypatch):
    """Leaders and followers give the scores of one standalone request per pair (the path of models whose
    prompt K/V cannot be forked), in waves of 2 sequences (several leaders of one context) as of 4."""
    from bestiary.core.bench import loglikelihood

    pairs = [(lm.tok_encode(c), lm.tok_encode(k)) for c in CONTEXTS for k in CONTINUATIONS]
    shared = loglikelihood.score_continuations(lm.llm, pairs)
    narrow = loglikelihood.score_continuations(lm.llm, pairs, max_in_flight=2)
    monkeypatch.setattr(lm.llm.executor, "can_fork", False)
    alone = loglikelihood.score_continuations(lm.llm, pairs)
    for a, b, c in zip(shared, narrow, alone):
        assert a[0] == pytest.approx(c[0], abs=1e-4) and b[0] == pytest.approx(c[0], abs=1e-4)
        assert a[1] == b[1] == c[1]
    lm.llm.executor.allocator.check_whole()


def test_continuation_longer_than_the_input_is_scored_alone(tiny, lm):
    """A continuation that fills the whole truncated input leaves no context to share: one standalone
    request, scored on its last max_length tokens as `hf` truncates."""
    from bestiary.core.bench import loglikelihood

    longest = loglikelihood.max_score_length(lm.llm)
    continuation = [(7 * i) % 90 + 3 for i in range(longest + 5)]
    ((logp, _),) = loglikelihood.score_continuations(lm.llm, [([1], continuation)])
    whole = continuation[-(longest + 1):]
    with torch.no_grad():
        ref = tiny[2](torch.tensor([whole[:-1]])).logits[0].log_softmax(-1)  # [longest, V]
    assert logp == pytest.approx(float(ref.gather(1, torch.tensor(whole[1:])[:, None]).sum()), abs=1e-3)


def test_loglikelihood_rolling_sums_every_token(tiny, lm):
    text = "Hello world! How are you today? I am fine, thank you. The capital of France is Paris."
    (got,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    tok, model = tiny[1], tiny[2]
    ids = [lm.prefix_token_id] + tok(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        logp = model(torch.tensor([ids[:-1]])).logits[0].log_softmax(-1)  # [n, V]
    assert got == pytest.approx(float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum()), abs=1e-3)


def test_generate_until_is_hf_greedy_cut_at_the_stop_string(tiny, lm):
    tok, model = tiny[1], tiny[2]
    args = [(c, {"until": ["."], "max_gen_toks": 12, "do_sample": False}) for c in CONTEXTS]
    got = lm.generate_until(_instances("generate_until", args))
    for (context, _), text in zip(args, got):
        ids = tok(context, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        assert text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split(".")[0]


def test_chat_template_with_and_without_generation_prompt(lm):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert lm.apply_chat_template(history[:1]).endswith("<|im_start|>assistant\n")
    assert lm.apply_chat_template(history, add_generation_prompt=False).endswith("<|im_start|>assistant\nHello")
    assert lm.chat_template(True) == lm.tokenizer.chat_template


def test_missing_engine_dir_is_one_line():
    from bestiary.core.bench.lm_eval_model import BestiaryLM
    from bestiary.core.format.errors import BestiaryError

    with pytest.raises(BestiaryError, match="engine_dir=PATH is required"):
        BestiaryLM()
    with pytest.raises(BestiaryError, match="max_batch_size=0: expected a positive integer"):
        BestiaryLM(engine_dir="x", max_batch_size="0")


def test_cli_runs_lm_eval_with_the_bestiary_model(tiny, tmp_path, capsys):
    """`bestiary lm-eval` passes lm-eval's own flags through and finds the "bestiary" model."""
    from lm_eval_tasks import read_results, write_tasks

    from bestiary.core.cli.main import main

    tasks = write_tasks(tmp_path, mc_count=4, gen_count=2, max_gen_toks=4)
    assert main(["lm-eval", "--model", "bestiary", "--model_args", f"engine_dir={tiny[0] / 'engine'},max_batch_size=2",
                 "--tasks", "bestiary_mc", "--include_path", str(tasks), "--output_path", str(tmp_path / "out")]) == 0
    assert "acc,none" in read_results(tmp_path / "out")["bestiary_mc"]


def test_lora_dir_scores_with_the_adapter(tiny, tmp_path):
    """lora_dir: every request runs with the PEFT adapter (the reference: PEFT on transformers)."""
    from lora_helpers import peft_adapter

    from bestiary.core.bench.lm_eval_model import BestiaryLM

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny[0] / "hf", dtype=torch.float32)
    peft_model = peft_adapter(hf, tmp_path / "adapter", seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    lm = BestiaryLM(engine_dir=str(tiny[0] / "engine"), lora_dir=str(tmp_path / "adapter"), max_batch_size=2)
    pairs = [(c, k) for c in CONTEXTS[:2] for k in CONTINUATIONS[:3]]
    got = lm.loglikelihood(_instances("loglikelihood", pairs))
    for (c, k), (logp, _) in zip(pairs, got):
        assert logp == pytest.approx(_hf_score(tiny[1], peft_model, c, k)[0], abs=1e-4), (c, k)
        assert abs(logp - _hf_score(tiny[1], tiny[2], c, k)[0]) > 1e-3, "the adapter changed nothing"
