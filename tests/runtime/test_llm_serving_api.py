"""The Python API the server stands on: n samples sharing the prompt's KV blocks, top-k log probs,
per-prompt SamplingConfigs, text stop strings, LLM.chat and chat templates rendered as transformers does."""

from __future__ import annotations

import asyncio

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.runtime.chat_template import render_chat  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.core.runtime.text_deltas import TextDeltas  # noqa: E402

FREE = dict(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_tiny_chat_engine(tmp_path_factory.mktemp("llm-api"), max_batch_size=8)


@pytest.fixture(scope="module")
def llm(engine):
    model = LLM(engine)
    yield model
    model.close()


@pytest.mark.parametrize("prompt_len", [11, 16, 3])  # a partial last block, whole blocks only, one block
def test_n_samples_fork_the_prompt_blocks_and_equal_single_seeded_runs(llm, prompt_len):
    """Sample i of n (seed s) is the n = 1 run with seed s + i, though it never computed the prompt."""
    ex = llm.executor
    prompt = list(range(5, 5 + prompt_len))
    req = ex.add(prompt, SamplingConfig(n=3, random_seed=5, **FREE))
    shared_checked = False
    while ex.has_work:
        ex.step()
        ex.check_kv_accounting()
        if req.forked and not shared_checked and not req.finished:
            full = prompt_len // ex.build.tokens_per_block
            assert all(ex.allocator.refs(b) == 3 for b in req.blocks[:full])  # one copy of the prompt
            assert all(s.blocks[:full] == req.blocks[:full] for s in req.siblings)
            shared_checked = True
    assert shared_checked
    ex.allocator.check_whole()
    samples = [s.output for s in req.group]
    assert len({tuple(s) for s in samples}) == 3
    singles = [llm.generate([prompt], SamplingConfig(random_seed=5 + i, **FREE))[0].output_ids for i in range(3)]
    assert samples == singles


def test_n_samples_through_generate_and_generate_async(llm):
    sampling = SamplingConfig(n=3, random_seed=9, output_log_probs=True, **FREE)
    (done,) = llm.generate(["Hello world"], sampling)
    assert [s.output_ids for s in done.samples][0] == done.output_ids
    assert len(done.samples) == 3 and all(len(s.log_probs) == 12 for s in done.samples)
    assert llm.last_stats.generated_tokens == 36

    async def main():
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        reasons = {}
        async for d in llm.generate_async("Hello world", sampling):
            got[d.index] += d.token_ids
            assert d.log_probs is not None and len(d.log_probs) == len(d.token_ids)
            if d.finish_reason:
                reasons[d.index] = d.finish_reason
        return got, reasons

    got, reasons = asyncio.run(main())
    assert [got[i] for i in range(3)] == [s.output_ids for s in done.samples]
    assert reasons == {0: "length", 1: "length", 2: "length"}
    llm.executor.allocator.check_whole()


def test_cancelling_a_request_before_its_prompt_is_computed_ends_every_sample(llm):
    ex = llm.executor
    req = ex.add(list(range(5, 40)), SamplingConfig(n=4, **FREE))
    ex.cancel(req)
    assert [s.finish_reason for s in req.group] == ["cancelled"] * 4
    ex.allocator.check_whole()
    with pytest.raises(BestiaryError, match="max_batch_size"):
        ex.add([5, 6], SamplingConfig(n=9))
    with pytest.raises(ValueError, match="beam_width"):
        SamplingConfig(n=2, beam_width=2)


def test_top_log_probs_are_the_largest_of_the_sampled_distribution(llm):
    (done,) = llm.generate([[5, 6, 7]], SamplingConfig(temperature=0.0, top_log_probs=4, **FREE))
    assert len(done.top_log_probs) == 12 == len(done.log_probs)
    for token, lp, top in zip(done.output_ids, done.log_probs, done.top_log_probs):
        assert [t for t, _ in top][0] == token and top[0][1] == pytest.approx(lp)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    # The values are log_softmax of the model's logits at that step.
    ids = [5, 6, 7]
    logits = llm.generate([ids], SamplingConfig(temperature=0.0, output_generation_logits=True, **FREE))[0]
    first = torch.log_softmax(logits.generation_logits[0], -1).topk(4)
    assert [t for t, _ in done.top_log_probs[0]] == first.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in done.top_log_probs[0]]), first.values, atol=1e-5)


def test_generate_takes_one_sampling_config_per_prompt(llm):
    configs = [SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (3, 7, 5)]
    done = llm.generate(["a", "b", [5, 6]], configs)
    assert [len(c.output_ids) for c in done] == [3, 7, 5]
    alone = llm.generate(["b"], configs[1])[0].output_ids
    assert done[1].output_ids == alone
    with pytest.raises(BestiaryError, match="2 SamplingConfigs for 3 prompts"):
        llm.generate(["a", "b", "c"], configs[:2])


def test_chat_takes_a_conversation_or_a_list(llm):
    greedy = SamplingConfig(temperature=0.0, **FREE)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (one,) = llm.chat(conversation, greedy)
    both = llm.chat([conversation, [{"role": "user", "content": "Hello"}]], greedy)
    assert len(both) == 2 and both[0].output_ids == one.output_ids
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(conversation), add_special_tokens=False)
    assert one.prompt_ids == ids


def test_stop_strings_cut_the_text_in_every_api(llm):
    full = llm.generate(["The quick"], SamplingConfig(temperature=0.0, max_new_tokens=30, ignore_eos=True))[0].text
    spots = [i for i in range(3, len(full) - 2) if full[i : i + 2].isprintable() and "\ufffd" not in full[i : i + 2]]
    stop = full[spots[len(spots) // 2] : spots[len(spots) // 2] + 2]
    expected = full[: full.find(stop)]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=30, ignore_eos=True, stop_strings=[stop])
    (done,) = llm.generate(["The quick"], sampling)
    assert (done.text, done.finish_reason) == (expected, "stop")
    assert len(done.output_ids) < 30
    assert "".join(llm.generate_stream("The quick", sampling)) == expected

    async def main():
        return [d async for d in llm.generate_async("The quick", sampling)]

    deltas = asyncio.run(main())
    assert "".join(d.text for d in deltas) == expected and deltas[-1].finish_reason == "stop"
    llm.generate([[5]], SamplingConfig(max_new_tokens=1))  # waits for the async stop queued on the worker
    llm.executor.allocator.check_whole()


class _Chars:
    """A tokenizer whose ids are characters (for TextDeltas)."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("text, stops, pieces", [
    ("hello world", ["wor"], ["h", "e", "l", "l", "o", " ", "", "", ""]),  # 'w', 'wo' held back, then the stop
    ("abcabd", ["abd", "x"], ["", "", "abc", "", "", ""]),
    ("abc", ["zz"], ["a", "b", "c"]),
    ("abc", ["bcd"], ["a", "", "bc"]),  # the end releases what was held back
])
def test_text_deltas_hold_back_possible_stop_prefixes(text, stops, pieces):
    deltas = TextDeltas(_Chars(), set(), stops)
    got = []
    for i, ch in enumerate(text):
        got.append(deltas.push([ord(ch)], final=i == len(text) - 1))
        if deltas.stopped:
            break
    assert got == pieces
    assert deltas.output == "".join(pieces)
    assert deltas.stopped == any(stop in text for stop in stops)


TEMPLATES = {
    "chatml": None,  # the tiny engine's own (tokenizer_config.json)
    "loopcontrols, tojson, namespace": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m | tojson }}{% if ns.n > 2 %}{% break %}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}{{ bos_token }}>{% endif %}"),
    "strip and raise": (
        "{{ bos_token }}{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m.role) }}{% endif %}  {{ m.role | upper }}: {{ m.content | trim }}\n"
        "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? \"quoted\" <b>"}],
    [{"role": "user", "content": "1"}, {"role": "assistant", "content": " 2 "}, {"role": "user", "content": "3"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "5"}],
]


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_templates_render_as_transformers_does(llm, engine, name, add_generation_prompt):
    hf = transformers.AutoTokenizer.from_pretrained(str(engine.parent / "hf"))
    template = TEMPLATES[name] or llm.tokenizer.chat_template
    for messages in CONVERSATIONS:
        theirs = hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                        add_generation_prompt=add_generation_prompt)
        ours = render_chat(template, messages, add_generation_prompt, llm.tokenizer.special_tokens)
        assert ours == theirs, messages


def test_chat_template_errors_are_user_errors():
    with pytest.raises(BestiaryError, match="bad role tool"):
        render_chat(TEMPLATES["strip and raise"], [{"role": "tool", "content": "x"}])
    with pytest.raises(BestiaryError, match="chat template: line 1"):
        render_chat("{% for m in messages %}", [])
