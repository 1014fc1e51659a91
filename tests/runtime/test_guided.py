"""Structured output composed with the rest of the runtime (core.runtime.guided): a guided request in a mixed
batch (free, LoRA) gives what it gives alone; sampling with penalties stays in the grammar; speculative
decoding (prompt lookup, drafts cut to the grammar, rejected drafts rolled back) gives the plain greedy
output; n > 1 gives n valid samples; beam search is refused; a bad constraint fails its own call alone;
max_new_tokens inside a structure ends "length".

All on a tiny random float32 LLaMA with a trained byte-level BPE tokenizer (tests/helpers/tiny_chat.py):
a random model's outputs walk the grammar anywhere it allows, which the judges (jsonschema, Python re)
check from outside.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

from test_lora_cache import seed_adapter  # noqa: E402 - the tiny model's random LoRA, shared
from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.runtime.guided import GuidedConfig  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "size": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "owner": {"type": ["string", "null"], "maxLength": 8}},
    "required": ["name", "size", "tags", "owner"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}-\d{2,4}(\.[a-z]{1,3})?"
PROMPT = "Describe an item as JSON."
GREEDY = {"temperature": 0.0}


def json_valid(text: str | None, schema: dict = SCHEMA) -> bool:
    try:
        return not list(jsonschema.Draft202012Validator(schema).iter_errors(json.loads(text or "")))
    except json.JSONDecodeError:
        return False


def guided(kind: str = "schema", **options) -> SamplingConfig:
    constraint = GuidedConfig(json_schema=SCHEMA) if kind == "schema" else GuidedConfig(regex=REGEX)
    return SamplingConfig(max_new_tokens=options.pop("max_new_tokens", 120), guided=constraint, **options)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return make_tiny_chat_engine(tmp_path_factory.mktemp("guided"), max_batch_size=16, max_seq_len=256)


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir)


def test_mixed_batch_equals_each_alone(llm):
    """guided, free, LoRA, guided + LoRA and a seeded sampled guided request in one generate call: each
    gives exactly its output alone; the guided ones are valid, and the grammar changed the output."""
    lora = seed_adapter(1)
    work = [("guided", guided(**GREEDY), None),
            ("free", SamplingConfig(max_new_tokens=40, ignore_eos=True, **GREEDY), None),
            ("lora", SamplingConfig(max_new_tokens=40, ignore_eos=True, **GREEDY), lora),
            ("guided+lora", guided(**GREEDY), lora),
            ("guided sampled", guided(temperature=0.9, random_seed=5), None),
            ("regex", guided("regex", **GREEDY), None)]
    together = llm.generate([PROMPT] * len(work), [s for _, s, _ in work], chat=True, lora=[a for *_, a in work])
    for (name, sampling, adapter), out in zip(work, together):
        alone = llm.generate(PROMPT, sampling, chat=True, lora=adapter)[0]
        assert out.output_ids == alone.output_ids, name
        assert out.finish_reason == alone.finish_reason, name
    by_name = dict(zip([w[0] for w in work], together))
    for name in ("guided", "guided+lora", "guided sampled"):
        assert by_name[name].finish_reason == "stop" and json_valid(by_name[name].text), (name, by_name[name].text)
    assert re.fullmatch(REGEX, by_name["regex"].text or ""), by_name["regex"].text
    assert by_name["free"].output_ids != by_name["lora"].output_ids, "the adapter must change the output"
    assert by_name["guided"].output_ids != by_name["guided+lora"].output_ids, "the adapter must change the output"
    assert not json_valid(by_name["free"].text), "the free output of a random model is not JSON"


@pytest.mark.parametrize("options", [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20, "repetition_penalty": 1.3},
    {"temperature": 0.7, "presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"temperature": 1.0, "top_p": 0.95, "repetition_penalty": 0.8, "embedding_bias": {10: 5.0, 60: 8.0}},
])
def test_sampling_and_penalties_stay_in_the_grammar(llm, options):
    """Penalties, a bias towards some tokens, temperature / top-k / top-p: 8 seeds each, every output valid."""
    outs = llm.generate([PROMPT] * 8, [guided(random_seed=s, **options) for s in range(8)], chat=True)
    assert all(o.finish_reason == "stop" and json_valid(o.text) for o in outs), [o.text for o in outs]
    assert len({o.text for o in outs}) > 1, "sampling with seeds gives different outputs"
    outs = llm.generate([PROMPT] * 8, [guided("regex", random_seed=s, **options) for s in range(8)], chat=True)
    assert all(o.finish_reason == "stop" and re.fullmatch(REGEX, o.text or "") for o in outs), [o.text for o in outs]


SPEC_PROMPTS = ['{"name": "ab", "size": 12, "tags": ["red", "green"], "owner": null}',
                'x {"name": "ab", "size": 12, "tags": ["red"], "owner": "cd"} {"name": "ab", "size": 12, "tags": '
                '["blue"], "owner": null}',
                PROMPT]  # plain text (no chat template): JSON for prompt lookup to copy, and none


def test_speculative_decoding_gives_the_plain_greedy_output(engine_dir, llm):
    """Prompt lookup drafts JSON copied from the prompt: the grammar cuts each draft, verification masks
    each row and rolls back the rejected tail. The output equals plain greedy decoding, token for token,
    and is valid; drafts were proposed, some accepted and some rejected (the rollback ran)."""
    spec = LLM(engine_dir, speculative={"method": "ngram", "num_draft_tokens": 4, "ngram_max": 3, "ngram_min": 1,
                                        "adaptive": False})  # k = 4 every step: the adaptive k reads timings
    prompts = SPEC_PROMPTS + [PROMPT]
    configs = [guided(**GREEDY)] * 3 + [SamplingConfig(max_new_tokens=40, **GREEDY)]
    plain = llm.generate(prompts, configs)
    fast = spec.generate(prompts, configs)
    assert [o.output_ids for o in fast] == [o.output_ids for o in plain]
    for out in fast[:3]:
        assert out.finish_reason == "stop" and json_valid(out.text), out.text
        stats = out.speculative
        assert stats is not None and stats.drafted > stats.accepted > 0, stats
    alone = spec.generate(prompts[0], configs[0])[0]  # batch 1: the same again
    assert alone.output_ids == plain[0].output_ids


def test_n_samples_are_each_valid(llm):
    """n = 6 sampled samples of one guided request: six independent matchers, six valid outputs."""
    out = llm.generate(PROMPT, guided(temperature=1.0, random_seed=3, n=6), chat=True)[0]
    assert len(out.samples) == 6
    assert all(s.finish_reason == "stop" and json_valid(s.text) for s in out.samples), [s.text for s in out.samples]
    assert len({s.text for s in out.samples}) > 1
    again = llm.generate(PROMPT, guided(temperature=1.0, random_seed=3, n=6), chat=True)[0]
    assert [s.output_ids for s in again.samples] == [s.output_ids for s in out.samples]


def test_beam_search_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="guided \\(json_schema\\) with beam_width 3: beam search cannot hold"):
        SamplingConfig(beam_width=3, guided=GuidedConfig(json_schema=SCHEMA))
    with pytest.raises(ValueError, match="guided \\(regex\\) with beam_width 2"):
        SamplingConfig.model_validate({"beam_width": 2, "guided": {"regex": "a+"}})


BAD = [
    (GuidedConfig(json_schema={"type": "object", "properties": {"a": {"type": "strng"}}}), "guided json_schema: "),
    (GuidedConfig(json_schema={"type": "object", "not": {"required": ["a"]}}), "guided json_schema: "),
    (GuidedConfig(regex="(unclosed"), "guided regex: "),
    (GuidedConfig(grammar="start: missing_rule\n"), "guided grammar: "),
    (GuidedConfig(grammar='root ::= "a" missing\n'), "guided grammar: not a GBNF grammar: Rule 'missing' not found"),
]


@pytest.mark.parametrize("bad, prefix", BAD, ids=["unknown type", "not", "regex", "lark", "gbnf"])
def test_a_bad_constraint_fails_its_call_alone(llm, bad, prefix):
    """A constraint llguidance cannot compile: one line BestiaryError from generate, nothing stays queued,
    and the good requests of the batch give the same outputs afterwards; under the async API, a request
    already running finishes with its own output."""
    good = [guided(**GREEDY), SamplingConfig(max_new_tokens=20, **GREEDY)]
    want = [o.output_ids for o in llm.generate([PROMPT] * 2, good, chat=True)]
    with pytest.raises(BestiaryError) as err:
        llm.generate([PROMPT] * 3, [good[0], SamplingConfig(guided=bad), good[1]], chat=True)
    assert str(err.value).startswith(prefix) and "\n" not in str(err.value), str(err.value)
    assert not llm.executor.has_work
    assert [o.output_ids for o in llm.generate([PROMPT] * 2, good, chat=True)] == want

    async def together():
        async def run(sampling):
            return [t async for d in llm.generate_async(PROMPT, sampling, chat=True) for t in d.token_ids]
        running = asyncio.ensure_future(run(good[0]))
        await asyncio.sleep(0)
        refused = await asyncio.gather(run(SamplingConfig(guided=bad)), return_exceptions=True)
        return await running, refused[0]

    first, refused = asyncio.run(together())
    assert isinstance(refused, BestiaryError) and str(refused).startswith(prefix)
    assert first[: len(want[0])] == want[0]  # the stream also carries the end id the completion leaves out


def test_max_new_tokens_inside_a_structure_ends_length(llm):
    """Out of tokens in the middle of the object: "length", a prefix of JSON, not a valid document."""
    out = llm.generate(PROMPT, guided(max_new_tokens=12, **GREEDY), chat=True)[0]
    assert out.finish_reason == "length" and len(out.output_ids) == 12
    assert out.text.startswith('{"name": "') and not json_valid(out.text), out.text
    full = llm.generate(PROMPT, guided(**GREEDY), chat=True)[0]
    assert full.finish_reason == "stop" and full.output_ids[:12] == out.output_ids


def test_choice_and_a_stopped_grammar_end_without_an_end_id(llm):
    """A choice's grammar is complete after its string: the request stops there ("stop", no end id)."""
    outs = llm.generate([PROMPT] * 4, [SamplingConfig(max_new_tokens=30, temperature=1.0, random_seed=s,
                                                      guided=GuidedConfig(choice=["alpha", "beta gamma", "delta"]))
                                       for s in range(4)], chat=True)
    stop_ids = llm.tokenizer.stop_ids
    for out in outs:
        assert out.finish_reason == "stop" and out.text in ("alpha", "beta gamma", "delta"), out.text
        assert not set(out.output_ids) & stop_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bans_that_forbid_every_grammar_token(llm, temperature):
    """bad_words ["a"] with regex "a" (the byte-level "a" is the only token the grammar allows first): before,
    greedy ended "stop" with text outside the grammar and sampling raised from multinomial, leaving the batch
    queued. The grammar wins over bans / penalties that leave it nothing: the output is "a"."""
    conflict = SamplingConfig(max_new_tokens=5, temperature=temperature, random_seed=1, bad_words=["a"],
                              guided=GuidedConfig(regex="a"))
    out = llm.generate("hi", conflict)[0]
    assert (out.text, out.finish_reason) == ("a", "stop"), (out.text, out.output_ids, out.finish_reason)
    assert not llm.executor.has_work


def test_a_failing_step_leaves_nothing_of_its_call_queued(llm, monkeypatch):
    """A step that raises (a plugin processor, Ctrl-C) ends generate with every request of the call cancelled."""
    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.executor, "_choose", broken)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["hi", "ho"], SamplingConfig(max_new_tokens=5))
    monkeypatch.undo()
    assert not llm.executor.has_work and llm.executor.allocator.num_used == 0
    assert llm.generate("hi", SamplingConfig(max_new_tokens=3))[0].finish_reason in ("stop", "length")


def test_tensor_and_pipeline_parallel_engines_hold_the_grammar(tmp_path):
    """tp 2 and pp 2 engines of the tiny chat model: rank 0 samples, so its matchers hold every request; the
    guided outputs equal the one-rank engine's (greedy, float32) and match their constraints."""
    from tiny_chat import make_tiny_chat_hf

    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    hf = make_tiny_chat_hf(tmp_path)
    configs = [SamplingConfig(max_new_tokens=24, temperature=0.0, guided=GuidedConfig(regex="[a-f]{2,6}-[0-9]{2}")),
               SamplingConfig(max_new_tokens=24, temperature=0.0, guided=GuidedConfig(choice=["north", "south"])),
               SamplingConfig(max_new_tokens=8, temperature=0.0)]
    texts = {}
    for name, options in {"one": {}, "tp2": {"tp_size": 2}, "pp2": {"pp_size": 2}}.items():
        ckpt = convert(hf, tmp_path / f"{name}-ckpt", ConvertOptions(**options), show_progress=False)
        engine = build_engine(ckpt, tmp_path / f"{name}-engine", BuildConfig(max_batch_size=4, max_seq_len=128,
                                                                              max_input_len=64, tokens_per_block=8))
        llm = LLM(engine)
        try:
            texts[name] = [o.text for o in llm.generate([PROMPT] * 3, configs)]
        finally:
            llm.close()
    assert re.fullmatch("[a-f]{2,6}-[0-9]{2}", texts["one"][0]) and texts["one"][1] in ("north", "south")
    assert texts["tp2"] == texts["one"] and texts["pp2"] == texts["one"]
