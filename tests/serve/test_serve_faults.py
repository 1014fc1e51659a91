"""The server under faults, in-process (fastapi's TestClient) on a tiny chat engine: an exception
injected at each stage of a request's life (parse, tokenize, template, add, step, format, stream,
timing), streamed or not, is answered (500 in OpenAI's shape, or an error event in a stream that
had begun), counted in /metrics, and leaves no waiting slot, running sequence or KV block held; the
next request is served. Also issue 47's items 1, 2, 5, 6 and 7 as one request each."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
testclient = pytest.importorskip("fastapi.testclient")
pytest.importorskip("transformers")

from tiny_chat import make_tiny_chat_engine  # noqa: E402

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from bestiary.core.runtime.llm import LLM

    return LLM(make_tiny_chat_engine(tmp_path_factory.mktemp("serve_faults")))


@pytest.fixture(scope="module")
def app(llm):
    from bestiary.core.serve.app import ServeSettings, create_app

    return create_app(llm, ServeSettings(served_model_name=MODEL, max_queue_len=2, max_request_bytes=64 * 1024))


@pytest.fixture(scope="module")
def client(app):
    with testclient.TestClient(app, raise_server_exceptions=False) as c:
        yield c


def held(app, llm) -> dict[str, int]:
    """What requests hold now: waiting slots, running sequences, KV blocks (0 each when idle)."""
    return {"waiting": app.state.metrics.num_waiting, "running": len(llm.executor.running),
            "kv_blocks": llm.executor.allocator.num_used}


def settled(app, llm, seconds: float = 10.0) -> dict[str, int]:
    """held() once everything is released (a cancel lands on the executor's next step), or after `seconds`."""
    deadline = time.monotonic() + seconds
    while any(held(app, llm).values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return held(app, llm)


def statuses(client, endpoint: str) -> dict[str, float]:
    """bestiary_requests_total{endpoint} by status."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("bestiary_requests_total{") and f'endpoint="{endpoint}"' in line:
            out[line.split('status="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def error_of(reply) -> dict:
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def post_raw(client, path: str, raw: bytes, content_type: str = "application/json"):
    return client.post(path, content=raw, headers={"Content-Type": content_type})


# --- issue 47, items 1, 2, 5, 6, 7 -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1, 10**40])
def test_a_seed_outside_64_bits_is_a_400_naming_seed_and_holds_no_slot(client, app, llm, seed):
    """Before: 500, and each such request kept a queue slot; after --max_queue_len of them, every request got 503."""
    for _ in range(3):  # more than max_queue_len (2)
        reply = client.post(CHAT, json={"model": MODEL, "messages": HI, "seed": seed, "max_tokens": 2})
        assert reply.status_code == 400 and error_of(reply)["param"] == "seed", reply.text
    assert settled(app, llm) == {"waiting": 0, "running": 0, "kv_blocks": 0}
    assert client.post(CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.0.content.0.text"),
    (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}', "messages.0.name"),
    (COMP, '{"model": "tiny", "prompt": "\\ud83d"}', "prompt"),
    (COMP, '{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}', "stop.0"),
    (COMP, '{"model": "\\ud800", "prompt": "x"}', "model"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, body, param):
    """Before: a plain-text 500 (TypeError: TextInputSequence must be str)."""
    reply = post_raw(client, path, body.encode())
    assert reply.status_code == 400, reply.text
    assert error_of(reply)["param"] == param and "surrogate" in error_of(reply)["message"]


def test_a_body_over_max_request_bytes_is_a_413_declared_or_chunked(client, app, llm):
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
    reply = post_raw(client, CHAT, big)
    assert reply.status_code == 413 and error_of(reply)["code"] == "request_too_large"
    assert "--max_request_bytes" in error_of(reply)["message"] and str(len(big)) in error_of(reply)["message"]
    chunked = client.post(CHAT, content=(big[i:i + 4096] for i in range(0, len(big), 4096)),
                          headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    assert settled(app, llm) == {"waiting": 0, "running": 0, "kv_blocks": 0}


def test_a_text_that_cannot_fit_is_refused_without_tokenizing_it(client, llm, monkeypatch):
    """A text longer than max_input_len x the longest token: 400 before the tokenizer sees it."""
    seen = []
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or [1])
    text = "word " * (llm.tokenizer.max_token_bytes * 128 * 2 // 5 + 10)  # max_input_len 128
    for path, body in [(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": text}]}),
                       (COMP, {"model": MODEL, "prompt": text})]:
        reply = client.post(path, json=body)
        assert reply.status_code == 400 and error_of(reply)["code"] == "context_length_exceeded", reply.text
    assert seen == []


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 10**9}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "max_completion_tokens": 250}, "max_completion_tokens"),
    (COMP, {"model": MODEL, "prompt": "Hello", "max_tokens": 256}, "max_tokens"),
    (COMP, {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
])
def test_max_tokens_past_the_context_is_a_400(client, path, body, param):
    """Before: max_tokens 10^9 was accepted (vLLM answers 400 when prompt + max_tokens exceeds the context)."""
    reply = client.post(path, json=body)
    assert reply.status_code == 400 and error_of(reply)["param"] == param, reply.text


@pytest.mark.parametrize("raw, content_type, param, words", [
    (b"[1, 2]", "application/json", None, "expected a JSON object, got an array"),
    (b'"hello"', "application/json", None, "expected a JSON object, got a string"),
    (b"hello", "text/plain", None, "Content-Type: text/plain"),
    (b"", "application/json", None, "empty"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": Infinity}',
     "application/json", "repetition_penalty", "finite"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     "application/json", "temperature", "finite"),
    (b'{"model": "tiny", "messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "application/json", None,
     "nested too deeply"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", None, "JSON"),
    (b'{"model": "tiny", "prompt": "x", "logit_bias": {"5": 1e400}}', "application/json", "logit_bias.5", "finite"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "application/json", None, "JSON"),
])
def test_a_bad_body_is_a_400_that_says_what_is_wrong(client, raw, content_type, param, words):
    """Before: a list body or a wrong Content-Type gave "Input should be a valid dictionary" (param null), an
    empty body "required", and repetition_penalty Infinity "sampling: : Value error, ..."."""
    reply = post_raw(client, COMP, raw, content_type) if b'"prompt"' in raw else post_raw(client, CHAT, raw,
                                                                                          content_type)
    assert reply.status_code == 400, reply.text
    error = error_of(reply)
    assert error["param"] == param and words in error["message"], error


def test_a_body_sent_without_content_type_json_is_read_as_json(client):
    """`curl -d` sends application/x-www-form-urlencoded."""
    raw = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 2}).encode()
    assert post_raw(client, CHAT, raw, "application/x-www-form-urlencoded").status_code == 200


def test_random_paths_share_one_metrics_series(client):
    for i in range(5):
        client.get(f"/no/such/path/{i}")
    text = client.get("/metrics").text
    assert 'endpoint="other",status="404"' in text and "/no/such" not in text


# --- an exception at each stage ----------------------------------------------------------------------------

class Boom(RuntimeError):
    pass


def after(calls: int, real):
    """`real`, raising Boom from its `calls`+1-th call on."""
    count = [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise Boom(f"injected after {calls} calls")
        return real(*args, **kwargs)

    return wrapped


def inject(stage: str, llm, monkeypatch) -> None:
    """Make `stage` of the next request raise."""
    from bestiary.core.serve import generation, metrics, request_body

    owner, name, calls = {  # what raises, and after how many calls that went through
        "parse": (request_body, "parse_body", 0), "template": (llm, "chat_ids", 0), "add": (llm.executor, "add", 0),
        "first step": (llm.executor, "step", 0), "later step": (llm.executor, "step", 3),
        "response body": (generation.Formatter, "response", 0), "stream chunk": (generation.Formatter, "chunk", 2),
        "timing": (metrics.RequestTimer, "tokens_arrived", 1),
    }[stage]
    monkeypatch.setattr(owner, name, after(calls, getattr(owner, name)))


COMMON = ["parse", "template", "add", "first step", "later step", "timing"]
STAGES = [(s, False) for s in [*COMMON, "response body"]] + [(s, True) for s in [*COMMON, "stream chunk"]]


@pytest.mark.parametrize("stage, stream", STAGES, ids=[f"{s}-{'stream' if m else 'json'}" for s, m in STAGES])
def test_an_exception_at_any_stage_is_answered_counted_and_releases_everything(client, app, llm, monkeypatch,
                                                                               stage, stream):
    body = {"model": MODEL, "messages": HI, "max_tokens": 12, "ignore_eos": True, "stream": stream, "n": 2}
    before = statuses(client, CHAT).get("500", 0.0)
    with monkeypatch.context() as patch:
        inject(stage, llm, patch)
        reply = client.post(CHAT, json=body)
    if reply.status_code == 200:  # the stream had begun: it ends with an error event, then [DONE]
        assert stream and stage in ("later step", "stream chunk", "timing"), reply.text
        events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error", events[-3:]
    else:
        assert reply.status_code == 500 and error_of(reply)["type"] == "server_error", reply.text
        assert statuses(client, CHAT)["500"] == before + 1
    assert settled(app, llm) == {"waiting": 0, "running": 0, "kv_blocks": 0}, stage
    assert client.post(CHAT, json=dict(body, stream=False)).status_code == 200
