"""`bestiary serve` in a subprocess on 127.0.0.1, driven with the official `openai` client (tiny random engine).

Every request loop is bounded in count and time (client timeouts, asyncio.wait_for).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.core.runtime.tokenizer import Tokenizer  # noqa: E402
from bestiary.core.serve.process import ServerProcess  # noqa: E402

MODEL = "tiny"
KEY = "sk-test"
PROMPTS = ["The quick brown fox", "Hello world! How are", "def add(a, b):", "Numbers: 0 1 2",
           "The capital of France", "Café", "A journey of a thousand", "I am fine"]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_tiny_chat_engine(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with ServerProcess(engine, "--api_key", KEY, "--served_model_name", MODEL, log=log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(engine):
    return Tokenizer.from_dir(engine)


def bestiary_run(engine, *args: str) -> list[list[int]]:
    """Output ids per input of `bestiary run --output_ids` (greedy)."""
    cmd = [sys.executable, "-m", "bestiary", "run", "--engine_dir", str(engine), "--output_ids", *args]
    result = subprocess.run(cmd, capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    return [[int(t) for t in line.split()] for line in result.stdout.decode().splitlines()]


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode([i for i in ids if i not in tokenizer.stop_ids])


def test_greedy_completions_and_chat_equal_bestiary_run(engine, client, tokenizer):
    expected = bestiary_run(engine, "--max_output_len", "12", "--ignore_eos", "--input_text", *PROMPTS[:3])
    for prompt, ids in zip(PROMPTS[:3], expected):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        assert got.choices[0].text == decode(tokenizer, ids)
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True, **GREEDY)
        assert "".join(c.choices[0].text for c in streamed) == decode(tokenizer, ids)
    # `bestiary run --chat` is LLM.generate(chat=True) (the slow SmolLM2 test runs the command itself)
    llm = LLM(engine)
    (chat,) = llm.generate([PROMPTS[1]], SamplingConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True), chat=True)
    chat_ids = chat.output_ids
    messages = [{"role": "user", "content": PROMPTS[1]}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, **GREEDY)
    assert got.choices[0].message.content == decode(tokenizer, chat_ids)
    assert got.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == decode(tokenizer, chat_ids)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_usage_and_finish_reasons(client, tokenizer):
    prompt = PROMPTS[0]
    got = client.completions.create(model=MODEL, prompt=[prompt, PROMPTS[2]], max_tokens=7, n=2, **GREEDY)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in got.choices)
    prompt_tokens = len(tokenizer.encode(prompt)) + len(tokenizer.encode(PROMPTS[2]))
    assert got.usage.prompt_tokens == prompt_tokens
    assert got.usage.completion_tokens == 4 * 7
    assert got.usage.total_tokens == prompt_tokens + 28
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, **GREEDY)
    rendered = tokenizer.apply_chat_template(messages)
    assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert chat.usage.completion_tokens == 3


def test_stop_strings_end_where_they_should(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=40, **GREEDY).choices[0].text
    clean = [i for i in range(4, len(full) - 3) if full[i : i + 2].isprintable() and "\ufffd" not in full[i : i + 2]]
    assert clean, f"no printable stretch in {full!r}"
    stop = full[clean[len(clean) // 2] : clean[len(clean) // 2] + 2]
    expected = full[: full.find(stop)]
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=40, stop=[stop, "\x07never"],
                                        stream=stream, **GREEDY)
        if stream:
            chunks = list(got)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = got.choices[0].text, got.choices[0].finish_reason
        assert (text, reason) == (expected, "stop"), stream


def test_n_samples_with_a_seed_are_distinct_and_reproducible(client):
    def texts(**kw):
        got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3,
                                             seed=11, max_tokens=12, temperature=1.0,
                                             extra_body={"ignore_eos": True}, **kw)
        return [c.message.content for c in sorted(got.choices, key=lambda c: c.index)]

    first = texts()
    assert len(set(first)) == 3
    assert texts() == first
    streamed = client.completions.create(model=MODEL, prompt="Hi", n=3, seed=11, max_tokens=8, stream=True,
                                         temperature=1.0, extra_body={"ignore_eos": True})
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert sorted(by_index) == [0, 1, 2] and len(set(by_index.values())) == 3


def test_logprobs_and_top_logprobs(client):
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                         logprobs=True, top_logprobs=3, **GREEDY)
    content = got.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy: the chosen token is the most likely
        assert entry.logprob < 0
    comp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=2, **GREEDY)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(alts) <= 2 for alts in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text or "\ufffd" in "".join(lp.tokens)


def test_32_concurrent_async_clients_equal_sequential_results(server, client):
    sequential = [client.completions.create(model=MODEL, prompt=p, max_tokens=10, **GREEDY).choices[0].text
                  for p in PROMPTS]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)

        async def one(i: int) -> str:
            prompt = PROMPTS[i % len(PROMPTS)]
            if i % 2:
                stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=10, stream=True,
                                                          **GREEDY)
                return "".join([c.choices[0].text async for c in stream])
            got = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=10, **GREEDY)
            return got.choices[0].text

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=120)
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert results == [sequential[i % len(PROMPTS)] for i in range(32)]
    assert server.wait_for_kv_blocks_free() == 0


def test_client_disconnect_cancels_and_frees_kv_blocks(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert server.metric("bestiary_kv_blocks_used") > 0
        assert server.wait_for_kv_blocks_free(5.0) == 0  # closed mid-stream: cancelled, blocks back
        # Not streaming: 8 samples x 240 tokens with top log probs (many slow steps); the client gives up.
        body.update(stream=False, n=8, logprobs=5)
        before = server.metric("bestiary_generation_tokens_total")
        with pytest.raises(httpx.TimeoutException):
            http.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=0.1)
        assert server.wait_for_kv_blocks_free(5.0) == 0
        assert server.metric("bestiary_generation_tokens_total") - before < 8 * 240  # cut short


def _post(server, path: str, body, key: str | None = KEY, raw: bytes | None = None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=TIMEOUT)


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = [  # (name, path, body, raw body, key, status, param, words in the message)
    ("malformed json", COMP, None, b'{"model": "tiny", "prompt": ', KEY, 400, None, "not valid JSON"),
    ("body not an object", COMP, None, b'[1, 2]', KEY, 400, None, ""),
    ("max_tokens wrong type", COMP, {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, None, KEY, 400,
     "max_tokens", "integer"),
    ("negative max_tokens", COMP, {"model": MODEL, "prompt": "x", "max_tokens": -5}, None, KEY, 400, "max_tokens", ""),
    ("n too large", CHAT, {"model": MODEL, "messages": HI, "n": 100}, None, KEY, 400, "n", "max_batch_size"),
    ("n zero", CHAT, {"model": MODEL, "messages": HI, "n": 0}, None, KEY, 400, "n", ""),
    ("temperature -1", CHAT, {"model": MODEL, "messages": HI, "temperature": -1}, None, KEY, 400, "temperature", ""),
    ("top_p 0", COMP, {"model": MODEL, "prompt": "x", "top_p": 0}, None, KEY, 400, "top_p", ""),
    ("presence_penalty 3", COMP, {"model": MODEL, "prompt": "x", "presence_penalty": 3}, None, KEY, 400,
     "presence_penalty", ""),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": HI}, None, KEY, 404, "model", "gpt-9"),
    ("huge prompt", COMP, {"model": MODEL, "prompt": "The quick brown fox " * 100}, None, KEY, 400, "prompt",
     "max_input_len"),
    ("huge prompt ids", COMP, {"model": MODEL, "prompt": list(range(5, 205))}, None, KEY, 400, "prompt",
     "max_input_len"),
    ("bad key", CHAT, {"model": MODEL, "messages": HI}, None, "sk-wrong", 401, None, "API key"),
    ("missing key", CHAT, {"model": MODEL, "messages": HI}, None, None, 401, None, "API key"),
    ("missing messages", CHAT, {"model": MODEL}, None, KEY, 400, "messages", "required"),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, None, KEY, 400, "messages", ""),
    ("unknown role", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None, KEY, 400,
     "messages.0.role", ""),
    ("missing prompt", COMP, {"model": MODEL}, None, KEY, 400, "prompt", "required"),
    ("unknown field", COMP, {"model": MODEL, "prompt": "x", "temprature": 0.5}, None, KEY, 400, "temprature",
     "unrecognized"),
    ("logit_bias outside vocab", COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"99999": 5}}, None, KEY, 400,
     "logit_bias", "vocabulary"),
    ("logit_bias too big", COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"5": 500}}, None, KEY, 400,
     "logit_bias", ""),
    ("top_logprobs without logprobs", CHAT, {"model": MODEL, "messages": HI, "top_logprobs": 2}, None, KEY, 400,
     None, "logprobs"),
    ("empty stop string", COMP, {"model": MODEL, "prompt": "x", "stop": [""]}, None, KEY, 400, "stop", ""),
    ("image content part", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, KEY, 400, "messages.0.content", "text content"),
    ("unknown route", "/v1/engines", {}, None, KEY, 404, None, "Not Found"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, case):
    _, path, body, raw, key, status, param, words = case
    r = _post(server, path, body, key=key, raw=raw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and "\n" not in error["message"]
    assert error["param"] == param
    assert words.lower() in error["message"].lower()


def test_healthy_after_bad_requests_and_metrics(server, client):
    for case in BAD_REQUESTS[:6]:
        _post(server, case[1], case[2], key=case[4], raw=case[3])
    assert server.healthy()
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, **GREEDY).choices[0].finish_reason
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    for name in ("bestiary_requests_total", "bestiary_prompt_tokens_total", "bestiary_generation_tokens_total",
                 "bestiary_time_to_first_token_seconds_bucket", "bestiary_inter_token_latency_seconds_bucket",
                 "bestiary_requests_waiting", "bestiary_kv_blocks_used", "bestiary_kv_blocks_free"):
        assert name in text, name
    assert 'bestiary_requests_total{endpoint="/v1/completions",status="400"}' in text
    assert server.metric("bestiary_generation_tokens_total") > 0
    assert server.metric("bestiary_time_to_first_token_seconds_count") > 0
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_queue_limit_and_chat_template_override(engine, tmp_path):
    """A batch of one and --max_queue_len 2: of 8 requests at once, some wait and the rest get 503."""
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine

    single = build_engine(engine.parent / "ckpt", tmp_path / "single", BuildConfig(max_batch_size=1, max_seq_len=256))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    with ServerProcess(single, "--max_queue_len", "2", "--chat_template", str(template),
                       log=tmp_path / "server.log") as server:
        tok = Tokenizer.from_dir(single)
        r = _post(server, CHAT, {"model": "single", "messages": HI, "max_tokens": 2}, key=None)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("[user]Hi\n[assistant]", add_special_tokens=False))

        async def main():
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                body = {"model": "single", "prompt": "x", "max_tokens": 60, "ignore_eos": True}
                return await asyncio.wait_for(asyncio.gather(
                    *(http.post(f"{server.url}{COMP}", json=body) for _ in range(8))), timeout=120)

        statuses = sorted(r.status_code for r in asyncio.run(main()))
        assert statuses.count(503) >= 1 and statuses.count(200) >= 2, statuses
        assert server.healthy()
        assert server.wait_for_kv_blocks_free() == 0


@pytest.mark.parametrize("flags, words", [
    (["--chat_template", "/nonexistent/template.jinja"], "--chat_template /nonexistent/template.jinja: no such file"),
    (["--port", "70000"], "--port 70000"),
])
def test_serve_flag_mistakes_are_one_line_errors(engine, flags, words):
    cmd = [sys.executable, "-m", "bestiary", "serve", "--engine_dir", str(engine), *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert words in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
