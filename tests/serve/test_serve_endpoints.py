"""/v1/embeddings, /tokenize, /detokenize, `echo` and --request_timeout (docs/serving.md#embeddings-tokenize-
echo-and-time-limits): in-process on a tiny chat engine against LLM.embed / LLM.generate, and the docs'
own curl and openai-client examples run against a live server."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
testclient = pytest.importorskip("fastapi.testclient")
pytest.importorskip("transformers")

from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

MODEL = "smol"  # the docs' examples name it so
DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
TEXTS = ["The quick brown fox", "Hello world! How are you today?"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_tiny_chat_engine(tmp_path_factory.mktemp("endpoints"))


@pytest.fixture(scope="module")
def llm(engine):
    from bestiary.core.runtime.llm import LLM

    return LLM(engine)


def make_client(llm, **settings):
    from bestiary.core.serve.app import ServeSettings, create_app

    return testclient.TestClient(create_app(llm, ServeSettings(served_model_name=MODEL, **settings)),
                                 raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(llm):
    with make_client(llm) as c:
        yield c


def idle(llm, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while (llm.executor.running or llm.executor.allocator.num_used) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not llm.executor.running and llm.executor.allocator.num_used == 0


# --- embeddings ---------------------------------------------------------------------------------------------

def test_embeddings_equal_llm_embed_as_floats_and_base64(client, llm):
    expected = llm.embed(TEXTS)  # [2, H]
    reply = client.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ours = torch.tensor([d["embedding"] for d in body["data"]])
    assert [d["index"] for d in body["data"]] == [0, 1] and body["object"] == "list"
    assert (ours - expected).abs().max().item() <= 1e-6
    tokens = sum(len(llm.tokenizer.encode(t)) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    packed = client.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[1], "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(packed.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vector, expected[1].numpy(), atol=1e-6)  # one input alone vs in a batch of two
    ids = client.post("/v1/embeddings", json={"model": MODEL, "input": [llm.tokenizer.encode(t) for t in TEXTS]})
    assert torch.tensor([d["embedding"] for d in ids.json()["data"]]).sub(expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "dimensions": 7}, 400, "dimensions"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [5, 100000]}, 400, "input"),
    ({"input": "word " * 20000}, 400, "input"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "model": "other"}, 404, "model"),
])
def test_embedding_mistakes_are_named(client, llm, body, status, param):
    reply = client.post("/v1/embeddings", json={"model": MODEL, **body})
    assert reply.status_code == status and reply.json()["error"]["param"] == param, reply.text
    assert idle(llm)


def test_the_models_own_dimensions_are_accepted(client, llm):
    size = llm.engine.config.hidden_size
    reply = client.post("/v1/embeddings", json={"model": MODEL, "input": "x", "dimensions": size})
    assert reply.status_code == 200 and len(reply.json()["data"][0]["embedding"]) == size


# --- tokenize / detokenize ----------------------------------------------------------------------------------

def test_tokenize_and_detokenize_round_trip(client, llm):
    for text in [*TEXTS, "Café, naïve, 数字."]:
        ids = client.post("/tokenize", json={"prompt": text}).json()
        assert ids["tokens"] == llm.tokenizer.encode(text) and ids["count"] == len(ids["tokens"])
        assert ids["max_model_len"] == llm.engine.build.max_seq_len and ids["token_strs"] is None
        back = client.post("/detokenize", json={"model": MODEL, "tokens": ids["tokens"]}).json()
        assert back["prompt"] == llm.tokenizer.decode(ids["tokens"], skip_special_tokens=False)
        assert llm.tokenizer.encode(back["prompt"], add_special_tokens=False) == [
            t for t in ids["tokens"] if t != llm.tokenizer.bos_id or not llm.tokenizer.config.get("add_bos_token")]


def test_tokenize_messages_applies_the_chat_template(client, llm):
    messages = [{"role": "user", "content": "Hi"}]
    reply = client.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert reply["tokens"] == llm.chat_ids(messages)
    assert reply["token_strs"][0] == "<|im_start|>" and len(reply["token_strs"]) == reply["count"]
    bad = client.post("/tokenize", json={"prompt": "x", "messages": messages})
    assert bad.status_code == 400 and "either prompt or messages" in bad.json()["error"]["message"]
    outside = client.post("/detokenize", json={"tokens": [1, 10**6]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"


# --- echo ---------------------------------------------------------------------------------------------------

def test_echo_with_max_tokens_0_gives_the_prompt_log_probs_of_llm_generate(client, llm):
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = llm.tokenizer.encode(prompt)
    done = llm.generate([ids], SamplingConfig(max_new_tokens=1, output_context_logits=True))[0]
    logp = torch.log_softmax(done.context_logits.float(), dim=-1)
    expected = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    reply = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True,
                                                 "logprobs": 2})
    assert reply.status_code == 200, reply.text
    choice, usage = reply.json()["choices"][0], reply.json()["usage"]
    assert choice["text"] == prompt and usage["completion_tokens"] == 0
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None and np.allclose(got[1:], expected, atol=1e-5)
    assert choice["logprobs"]["top_logprobs"][0] is None and len(choice["logprobs"]["top_logprobs"][1]) == 2
    assert len(choice["logprobs"]["tokens"]) == len(ids) == len(choice["logprobs"]["text_offset"])


def test_echo_puts_the_prompt_before_the_completion_streamed_or_not(client):
    body = {"model": MODEL, "prompt": "Hello world!", "max_tokens": 5, "echo": True, "temperature": 0,
            "ignore_eos": True}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    unechoed = client.post("/v1/completions", json=dict(body, echo=False)).json()["choices"][0]["text"]
    assert plain == "Hello world!" + unechoed
    events = client.post("/v1/completions", json=dict(body, stream=True)).text.splitlines()
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"].startswith("Hello world!")
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain
    refused = client.post("/v1/completions", json=dict(body, echo=False, max_tokens=0))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


# --- time limit ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_request_timeout_is_cancelled_and_gives_everything_back(llm, client, stream):
    """16 x 240 tokens with top log probs (seconds of work on the tiny engine) against a 0.2 s limit."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "n": 16, "logprobs": 5,
            "stream": stream}
    with make_client(llm, request_timeout=0.2) as c:
        start = time.monotonic()
        reply = c.post("/v1/completions", json=body)
        took = time.monotonic() - start
        if stream and reply.status_code == 200:  # the stream began: it ends with the timeout's error event
            events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", reply.text[-500:]
            assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        else:
            assert reply.status_code == 408 and reply.json()["error"]["code"] == "request_timeout", reply.text
        assert took < 10
        assert idle(llm) and c.app.state.metrics.num_waiting == 0
    assert client.post("/v1/completions", json=dict(body, max_tokens=2, n=1, stream=False)).status_code == 200


# --- the docs' examples, live -------------------------------------------------------------------------------

def docs_examples() -> dict[str, list[str]]:
    """The bash and python blocks of serving.md's embeddings section."""
    text = DOCS.read_text()
    section = text[text.index("## Embeddings, tokenize, echo and time limits"):]
    section = section[: section.index("\n## ", 1)]
    return {lang: re.findall(rf"```{lang}\n(.*?)```", section, re.S) for lang in ("bash", "python")}


@pytest.mark.slow
def test_the_docs_examples_run_against_a_live_server(engine, tmp_path):
    pytest.importorskip("openai")
    from bestiary.core.serve.process import ServerProcess

    blocks = docs_examples()
    assert len(blocks["bash"]) == 1 and len(blocks["python"]) == 1
    with ServerProcess(engine, "--api_key", "sk-local", "--served_model_name", MODEL, log=tmp_path / "log") as s:
        for command in re.split(r"\n(?=curl )", blocks["bash"][0].strip()):
            command = "\n".join(line for line in command.splitlines() if not line.startswith("#"))
            out = subprocess.run(["bash", "-c", command.replace("http://127.0.0.1:8000", s.url)], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0 and "error" not in json.loads(out.stdout), (command, out.stdout[:500])
        script = blocks["python"][0].replace("http://127.0.0.1:8000", s.url)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines()[0].startswith("2 ")
