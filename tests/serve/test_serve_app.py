"""The serve app in-process (fastapi's TestClient) on a tiny engine without a tokenizer: its route
table, and requests the subprocess tests (test_serve.py) do not send."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
testclient = pytest.importorskip("fastapi.testclient")

from tiny_llama import make_tiny_engine  # noqa: E402

MODEL = "tiny"
ROUTES = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/"), ("GET", "/static/chat.js"), ("GET", "/v1/models"),
          ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The app on a tiny Llama engine that has no tokenizer."""
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.serve.app import ServeSettings, create_app

    llm = LLM(make_tiny_engine(tmp_path_factory.mktemp("serve_app")) / "engine")
    assert llm.tokenizer is None
    return create_app(llm, ServeSettings(served_model_name=MODEL))


@pytest.fixture(scope="module")
def client(app):
    with testclient.TestClient(app) as c:
        yield c


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_documented_route_answers(client, method, path):
    reply = client.request(method, path, json={} if method == "POST" else None)
    assert reply.status_code == (400 if method == "POST" else 200), reply.text  # POST {}: "model: required"


def test_a_wrong_method_is_a_405_in_openai_shape(client):
    reply = client.get("/v1/completions")
    assert reply.status_code == 405 and set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_null_max_tokens_means_the_default_16(client):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": None, "temperature": 0.0, "ignore_eos": True}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 16


def test_logprobs_without_a_tokenizer_are_a_400_naming_logprobs(client):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 1}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "logprobs" and "tokenizer" in reply.json()["error"]["message"]
