"""`bestiary serve --speculative ngram` end to end over HTTP (tiny random chat engine, official `openai`
client): greedy text equals plain decoding, /metrics counts drafts, and every response carries the
request's own acceptance counts in `usage.speculative` (non-streamed, and streamed with include_usage)."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.core.serve.process import ServerProcess  # noqa: E402

MODEL = "tiny"
# repeated phrases: prompt lookup finds drafts in the prompt, and the random model's greedy loops in its output
PROMPTS = ["The quick brown fox jumps. The quick brown fox jumps. The quick brown",
           "Numbers: 0 1 2 3 4 5 6 0 1 2 3 4 5 6 0 1 2", "Hello world! Hello world! Hello"]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
SPEC_FIELDS = {"steps", "drafted_tokens", "accepted_tokens", "acceptance_rate"}
DRAFTED, ACCEPTED, STEPS = (f"bestiary_spec_decode_{n}_total" for n in ("draft_tokens", "accepted_tokens", "steps"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_tiny_chat_engine(tmp_path_factory.mktemp("spec-serve"), max_batch_size=4)


@pytest.fixture(scope="module")
def plain(engine):
    """Plain greedy decoding of the same engine, in process: the text of 24 new tokens per prompt."""
    llm = LLM(engine)
    done = llm.generate(PROMPTS, SamplingConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    return llm, [d.text for d in done]


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("spec-serve-log") / "server.log"
    # a fixed k: the counts of a request then depend on its tokens only (adaptive k also follows step timings)
    with ServerProcess(engine, "--served_model_name", MODEL, "--speculative", "ngram", "--num_draft_tokens", "4",
                       "--fixed_draft_tokens", log=log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60.0, max_retries=0)


def spec_of(usage) -> dict:
    """usage.speculative through the openai client's pydantic model (an extra field)."""
    extra = usage.model_extra["speculative"]
    assert extra == usage.model_dump()["speculative"] and set(extra) == SPEC_FIELDS
    return extra


def counters(server) -> tuple[float, float, float]:
    return server.metric(DRAFTED), server.metric(ACCEPTED), server.metric(STEPS)


def test_greedy_equals_plain_and_metrics_count_each_requests_drafts(server, client, plain):
    """Every completion equals plain greedy decoding; each request's usage.speculative is exactly
    what /metrics' counters grew by while it ran (requests run one after the other)."""
    llm, expected = plain
    totals = {"drafted_tokens": 0, "accepted_tokens": 0}
    start = counters(server)
    for prompt, text in zip(PROMPTS, expected):
        before = counters(server)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
        assert got.choices[0].text == text
        spec = spec_of(got.usage)
        after = counters(server)
        assert (spec["drafted_tokens"], spec["accepted_tokens"], spec["steps"]) == tuple(
            a - b for a, b in zip(after, before))
        assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"] <= 4 * spec["steps"]
        assert spec["acceptance_rate"] == (spec["accepted_tokens"] / spec["drafted_tokens"]
                                           if spec["drafted_tokens"] else 0.0)
        assert spec["accepted_tokens"] + spec["steps"] <= got.usage.completion_tokens  # each step emits 1 + accepted
        for key in totals:
            totals[key] += spec[key]
    end = counters(server)
    assert end[0] - start[0] == totals["drafted_tokens"] > 0  # drafted, and /metrics saw it
    assert end[1] - start[1] == totals["accepted_tokens"] > 0  # some drafts accepted (the prompts repeat)


def test_streamed_usage_and_chat_carry_the_same_counts(client, plain):
    """A streamed completion with include_usage: the same text, and its last chunk's usage.speculative
    equals the non-streamed request's (greedy: the same drafts and verifications); chat and n > 1 too."""
    llm, expected = plain
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected[1]
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert spec_of(chunks[-1].usage) == spec_of(whole.usage) and spec_of(whole.usage)["drafted_tokens"] > 0
    # two prompts in one request: the counts of both choices, summed
    both = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=24, **GREEDY)
    assert [c.text for c in both.choices] == expected[:2]
    assert spec_of(both.usage)["drafted_tokens"] > spec_of(whole.usage)["drafted_tokens"]
    messages = [{"role": "user", "content": PROMPTS[2]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, **GREEDY)
    (reference,) = llm.generate([llm.chat_ids(messages)], SamplingConfig(max_new_tokens=16, temperature=0.0,
                                                                         ignore_eos=True))
    assert chat.choices[0].message.content == reference.text
    assert spec_of(chat.usage)["steps"] > 0
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                                   stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert spec_of(streamed[-1].usage) == spec_of(chat.usage)


def test_sampled_requests_report_counts_and_plain_servers_no_field(server, engine):
    """A sampled request is verified by the acceptance rule and reports its counts too; a server
    without --speculative answers OpenAI's usage object unchanged (no extra field)."""
    from bestiary.core.serve.generation import Formatter

    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0.8, "seed": 1, "ignore_eos": True}
    usage = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60.0).json()["usage"]
    assert usage["completion_tokens"] == 24 and set(usage["speculative"]) == SPEC_FIELDS
    fmt = Formatter(LLM(engine), MODEL, False, 1, 5, False)
    assert fmt.usage(3) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
