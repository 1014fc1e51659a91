"""response_format and tools on the server (docs/serving.md#tools-and-response_format), in-process on
SmolLM2-135M-Instruct (whose template ignores `tools`: the fallback prompt) with the official openai
client: JSON that validates, `parse()` into a pydantic model, a tool call round trip streamed and not,
the 400s of bad constraints (a free request running beside them unaffected)."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi")
testclient = pytest.importorskip("fastapi.testclient")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from pydantic import BaseModel  # noqa: E402

MODEL = "smol"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                         "is_capital": {"type": "boolean"}},
        "required": ["name", "country", "is_capital"], "additionalProperties": False}
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 40}


class City(BaseModel):
    name: str
    country: str
    is_capital: bool


@pytest.fixture(scope="module")
def llm(smollm2_fp32_engine):
    from bestiary.core.runtime.llm import LLM

    llm = LLM(smollm2_fp32_engine)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def http(llm):
    from bestiary.core.serve.app import ServeSettings, create_app

    with testclient.TestClient(create_app(llm, ServeSettings(served_model_name=MODEL)),
                               raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_response_format_json_schema_validates(client):
    got = client.chat.completions.create(
        messages=[{"role": "user", "content": "What is the largest city of France?"}], **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content), CITY)
    text = client.completions.create(prompt="The answer is", extra_body={"guided_choice": ["yes", "no"]}, **GREEDY)
    assert text.choices[0].text in ("yes", "no")  # vLLM's extras, on /v1/completions too


def test_parse_into_a_pydantic_model(client):
    got = client.chat.completions.parse(messages=[{"role": "user", "content": "What is the largest city of France?"}],
                                        response_format=City, **GREEDY)
    assert got.choices[0].message.parsed == City(name="Paris", country="France", is_capital=True)  # the docs' example


def call_weather(client, stream: bool, **choice):
    """The first turn: (the assistant message as a dict, its call's arguments); streamed or not."""
    kw = dict(messages=ASK, tools=TOOLS, parallel_tool_calls=False, **GREEDY, **choice)
    if not stream:
        got = client.chat.completions.create(**kw)
        choice_ = got.choices[0]
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
        (call,) = choice_.message.tool_calls
        return choice_.message.model_dump(exclude_none=True), call
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0, "function", "get_weather", "")
    assert first.id.startswith("call_") and rest and all(d.id is None and d.function.name is None for d in rest)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)
    arguments = "".join(d.function.arguments for d in rest)
    message = {"role": "assistant", "tool_calls": [{"id": first.id, "type": "function",
                                                    "function": {"name": "get_weather", "arguments": arguments}}]}
    return message, openai.types.chat.ChatCompletionMessageToolCall.model_validate(message["tool_calls"][0])


@pytest.mark.parametrize(("stream", "choice"), [
    (False, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    (True, {"tool_choice": "required"}),
])
def test_tool_call_round_trip(client, http, stream, choice):
    message, call = call_weather(client, stream, **choice)
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    history = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'}]
    kw = dict(messages=history, tools=TOOLS, tool_choice="none", **GREEDY)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        answer = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert all(c.choices[0].delta.tool_calls is None for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        got = client.chat.completions.create(**kw).choices[0]
        answer, finish = got.message.content, got.finish_reason
        assert got.message.tool_calls is None
    assert answer and finish in ("stop", "length")
    # the tool's result reached the prompt (the fallback renders it as a user turn)
    ids = http.post("/tokenize", json={"messages": history}).json()["tokens"]
    prompt = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<|im_start|>user\n<tool_response>\n{"temperature_c": 21}\n</tool_response>' in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' in prompt


BAD = [  # (body fields, the param the 400 names, words of its message)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_grammar": "start: (\n"}, "guided_grammar", "guided grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one constraint"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "format": "x"}}}]},
     "tools.0.function.parameters", "Unknown format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": TOOLS, "guided_regex": "a"}, "tools", "guided_regex"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls", "assistant"),
]


def test_bad_constraints_are_400s_and_a_free_request_beside_them_is_unaffected(http):
    free = {"messages": [{"role": "user", "content": "Name three colors."}], **GREEDY}
    alone = http.post("/v1/chat/completions", json=free).json()["choices"][0]["message"]["content"]
    results: dict[str, str] = {}
    running = threading.Event()

    def run_free() -> None:  # streamed: the bad requests come in while it generates
        events = []
        with http.stream("POST", "/v1/chat/completions", json={**free, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    running.set()
        results["free"] = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])

    worker = threading.Thread(target=run_free)
    worker.start()
    assert running.wait(120)
    for fields, param, words in BAD:
        r = http.post("/v1/chat/completions", json={"messages": ASK, **GREEDY, **fields})
        assert r.status_code == 400, (fields, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (fields, error)
    guided = http.post("/v1/chat/completions", json={"messages": ASK, **GREEDY, "guided_choice": ["sunny", "rainy"]})
    assert guided.json()["choices"][0]["message"]["content"] in ("sunny", "rainy")
    worker.join(timeout=120)
    assert results["free"] == alone
