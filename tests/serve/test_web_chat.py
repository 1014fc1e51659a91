"""The web chat page of `bestiary serve` in a real browser (Debian's chromium, Playwright), and LoRA
adapters served as model names (`--lora_modules`), on a tiny random chat engine.

The page is driven as a user would: type, press Enter, read the streamed answer, press Stop,
reload. Answers are compared with the API's greedy answers to the same conversation. A stubbed
answer (Playwright's route) checks the Markdown rendering in the page: code blocks, lists, links,
and that HTML in model output stays text.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from lora_helpers import peft_adapter  # noqa: E402
from tiny_chat import make_tiny_chat_engine  # noqa: E402
from web_browser import (  # noqa: E402
    answer_of,
    chromium,
    console_errors,
    open_chat,
    screenshot,
    send,
    set_sampling,
    wait_for_models,
)

from bestiary.core.cli.serve import lora_modules  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.lora.request import LoraRequest  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.core.serve.process import ServerProcess  # noqa: E402

MODEL, ADAPTER, KEY = "tiny", "tiny-lora", "sk-web"
NEW_TOKENS = 12
LONG = 8192  # max_seq_len of the engine
LONG_ANSWER = LONG - 512  # max_tokens long enough to be stopped mid-stream even on a loaded machine; + prompt <= LONG
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine dir, adapter dir): the tiny chat engine and a random rank-4 PEFT adapter of its HF model."""
    base = tmp_path_factory.mktemp("web")
    engine = make_tiny_chat_engine(base, max_seq_len=LONG)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base / "hf")
    peft_adapter(hf, base / "adapter", seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return engine, base / "adapter"


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    engine, adapter = served
    log = tmp_path_factory.mktemp("web-log") / "server.log"
    with ServerProcess(engine, "--api_key", KEY, "--served_model_name", MODEL,
                       "--lora_modules", f"{ADAPTER}={adapter}", log=log) as s:
        yield s


def api(server, path: str, body: dict | None = None) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    if body is None:
        response = httpx.get(f"{server.url}{path}", headers=headers, timeout=60)
    else:
        response = httpx.post(f"{server.url}{path}", headers=headers, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def api_answer(server, messages: list[dict], model: str = MODEL) -> str:
    """The API's greedy answer (what the page must show for the same conversation)."""
    body = {"model": model, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "top_p": 1}
    return api(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]


# --- LoRA adapters as model names (no browser) ---------------------------------------------

def test_lora_modules_are_served_model_names(server, served):
    engine, adapter = served
    cards = api(server, "/v1/models")["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), (ADAPTER, MODEL)]
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    llm = LLM(engine)
    try:
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS)
        (with_adapter,) = llm.chat(messages, greedy, lora=LoraRequest(ADAPTER, adapter))
        (base,) = llm.chat(messages, greedy)
    finally:
        llm.close()
    got = api(server, "/v1/chat/completions", {"model": ADAPTER, "messages": messages, "max_tokens": NEW_TOKENS,
                                                "temperature": 0})
    assert got["model"] == ADAPTER
    assert got["choices"][0]["message"]["content"] == with_adapter.text != base.text
    assert api_answer(server, messages) == base.text
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "other", "messages": messages}, timeout=60)
    assert response.status_code == 404 and ADAPTER in response.json()["error"]["message"]


@pytest.mark.parametrize("spec, words", [
    ("tiny-lora", "--lora_modules tiny-lora: expected NAME=DIR"),
    ("=dir", "--lora_modules =dir: expected NAME=DIR"),
    ("tiny=.", "the model name 'tiny' is already served"),
    ("x=/nonexistent/adapter", "/nonexistent/adapter is not a directory"),
])
def test_lora_modules_mistakes_are_named(spec, words):
    with pytest.raises(BestiaryError, match=re.escape(words)):
        lora_modules([spec], "tiny")
    with pytest.raises(BestiaryError, match="'a' is already served"):
        lora_modules(["a=.", "a=."], "tiny")
    assert lora_modules(["a=.", "b=."], "tiny") == {"a": ".", "b": "."}


def test_a_bad_adapter_is_a_one_line_error_at_start(served, tmp_path):
    engine, _ = served
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                              "target_modules": ["query_key_value"]}))
    cmd = [sys.executable, "-m", "bestiary", "serve", "--engine_dir", str(engine), "--lora_modules", f"bad={tmp_path}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "query_key_value" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# --- the page in chromium ------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


@pytest.fixture
def page(browser, server):
    """The chat page in a fresh browser context (empty localStorage), the API key entered."""
    page = open_chat(browser, server.url, KEY, TIMEOUT_MS, viewport={"width": 1000, "height": 760})
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    yield page
    assert not errors, errors
    page.context.close()


def chat_bodies(page) -> list[dict]:
    """The bodies of the page's /v1/chat/completions requests, as they are sent."""
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
    return bodies


def test_page_streams_the_greedy_answer_and_keeps_the_history(page, server, tmp_path):
    bodies = chat_bodies(page)
    set_sampling(page, 0, NEW_TOKENS)
    first, second = "Hello world! How are you today?", "The capital of France"
    send(page, first)
    a1 = answer_of(page, 0)
    assert a1 == api_answer(server, [{"role": "user", "content": first}])
    assert re.fullmatch(r"\d+ tokens, [\d.]+ tokens/s.*", page.text_content("#status"))
    send(page, second)
    a2 = answer_of(page, 1)
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": a1},
               {"role": "user", "content": second}]
    assert bodies[1]["messages"] == history and bodies[1]["stream"] is True
    assert a2 == api_answer(server, history)
    assert a2 != api_answer(server, history[2:]), "the history must change the answer"
    screenshot(page, tmp_path / "web-chat.png")
    page.click("#new-chat")  # a new conversation forgets the history
    send(page, second)
    assert answer_of(page, 0) == api_answer(server, history[2:])
    assert bodies[-1]["messages"] == history[2:]


def test_stop_cancels_the_request_and_frees_its_kv_blocks(page, server):
    def long_answer(route):  # no EOS: the answer runs to max_tokens unless stopped
        body = route.request.post_data_json
        route.continue_(post_data=json.dumps(dict(body, ignore_eos=True)))

    page.route("**/v1/chat/completions", long_answer)
    set_sampling(page, 0, LONG_ANSWER)
    generated = server.metric("bestiary_generation_tokens_total")
    with page.expect_response("**/v1/chat/completions"):  # the server answers once the first token is out
        send(page, "Numbers: 0 1 2")
    page.locator(".message.assistant[data-state=streaming] .text > *").first.wait_for(state="attached")  # rendered
    assert page.is_visible("#stop") and page.is_disabled("#send")
    page.click("#stop")
    partial = answer_of(page, 0, "stopped")
    assert "stopped after" in page.text_content("#status")
    assert server.wait_for_kv_blocks_free() == 0
    # Cut before max_tokens, and nothing more is generated for it. (How many tokens come out between
    # the click and the cancellation depends on the machine's load: a count bound would be flaky.)
    stopped_at = server.metric("bestiary_generation_tokens_total")
    assert stopped_at - generated < LONG_ANSWER, "not stopped mid-stream"
    time.sleep(0.5)
    assert server.metric("bestiary_generation_tokens_total") == stopped_at, "still generating after stop"
    assert page.is_hidden("#stop") and page.is_enabled("#send")
    page.unroute("**/v1/chat/completions")
    bodies = chat_bodies(page)
    set_sampling(page, 0, NEW_TOKENS)  # the server goes on serving; the partial answer stays in the history
    send(page, "Hello")
    answer = answer_of(page, 1)
    assert bodies[0]["messages"] == [{"role": "user", "content": "Numbers: 0 1 2"},
                                     {"role": "assistant", "content": partial}, {"role": "user", "content": "Hello"}]
    assert answer == api_answer(server, bodies[-1]["messages"])  # (without the first turn if it grew too long)


def test_a_conversation_too_long_drops_its_oldest_turns(page, server):
    bodies = chat_bodies(page)
    set_sampling(page, 0, NEW_TOKENS)
    long_turns = [("The quick brown fox jumps over the lazy dog. " * 2).strip(),
                  ("A journey of a thousand miles begins with one step. " * 2).strip()]
    send(page, long_turns[0])
    first = answer_of(page, 0)
    send(page, long_turns[1])
    second = answer_of(page, 1)
    assert len(bodies) == 3  # the second turn was sent with the history, refused (too long), sent without it
    assert bodies[1]["messages"] == [{"role": "user", "content": long_turns[0]},
                                     {"role": "assistant", "content": first}, {"role": "user", "content": long_turns[1]}]
    assert bodies[2]["messages"] == [{"role": "user", "content": long_turns[1]}]
    assert second == api_answer(server, bodies[2]["messages"])
    assert "1 oldest turn(s) dropped" in page.text_content("#status")
    assert page.locator(".message.forgotten").count() == 2


def test_reload_lists_the_models_and_the_picker_chooses_the_adapter(page, server):
    page.reload()
    wait_for_models(page)
    options = page.eval_on_selector_all("#model option", "els => els.map(e => e.value)")
    assert options == [MODEL, ADAPTER]  # the key was kept (localStorage)
    page.select_option("#model", ADAPTER)
    page.reload()
    wait_for_models(page)
    assert page.input_value("#model") == ADAPTER
    set_sampling(page, 0, NEW_TOKENS)
    send(page, "Hello world! How are you today?")
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    assert answer_of(page, 0) == api_answer(server, messages, model=ADAPTER)


def test_phone_sized_window(browser, server, tmp_path):
    page = open_chat(browser, server.url, KEY, TIMEOUT_MS, viewport={"width": 375, "height": 667},
                     is_mobile=True, has_touch=True)
    set_sampling(page, 0, NEW_TOKENS)  # the settings opened to ask for the key
    page.click("#settings-toggle")
    assert page.is_hidden("#settings")
    send(page, "Hello world! How are you today?")
    answer_of(page, 0)
    width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], f"the page scrolls sideways: {width}"
    for selector in ("#input", "#send", "#model", "#settings-toggle"):
        box = page.locator(selector).bounding_box()
        assert box and 0 <= box["x"] and box["x"] + box["width"] <= 375 and box["y"] + box["height"] <= 667, selector
    screenshot(page, tmp_path / "web-chat-phone.png")
    page.context.close()


def test_page_assets_are_local_and_routes_are_closed(server):
    page = httpx.get(server.url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text), "the page loads something from elsewhere"
    for name, kind in (("markdown.js", "text/javascript"), ("chat.js", "text/javascript"), ("chat.css", "text/css")):
        asset = httpx.get(f"{server.url}/static/{name}", timeout=30)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
    assert httpx.get(f"{server.url}/static/../app.py", timeout=30).status_code == 404
    assert httpx.get(f"{server.url}/static/index.html", timeout=30).status_code == 404


# --- Markdown answers, the icon ----------------------------------------------------------------

# A model's answer with Markdown and injection attempts; "pwned" is set if any of it runs as code.
MARKDOWN = """## Setup

Install **bestiary** with `pip`:

```python
print("<script>window.__pwned = 1</script>")
```

- one
- two
  - nested

1. first
2. [the docs](https://example.com/docs) and [bad](javascript:window.__pwned=1)

<img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>"""


def sse(text: str, piece: int = 7) -> str:
    """The server-sent events of a streamed chat completion of `text`, in pieces of `piece` characters."""
    deltas = [{"content": text[k:k + piece]} for k in range(0, len(text), piece)]
    chunks: list[dict] = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(deltas),
                                            "total_tokens": 3 + len(deltas)}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_markdown_answers_are_rendered_and_inert(browser, server):
    """Without the page's CSP (bypass_csp), so that an injected handler or script would run."""
    page = open_chat(browser, server.url, KEY, TIMEOUT_MS, bypass_csp=True, viewport={"width": 1000, "height": 760})
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    bodies = chat_bodies(page)
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, content_type="text/event-stream",
                                                                     body=sse(MARKDOWN)))
    typed = "**not bold** <img src=x onerror=window.__pwned=1>"
    send(page, typed)
    assert answer_of(page, 0) == MARKDOWN
    user = page.locator(".message.user .text")
    assert user.text_content() == typed and user.evaluate("el => el.children.length") == 0  # plain text
    out = page.locator(".message.assistant .text")
    assert out.locator("h2").text_content() == "Setup"
    assert out.locator("p strong").text_content() == "bestiary" and out.locator("p code").text_content() == "pip"
    assert out.locator("pre code[data-lang=python]").text_content() == 'print("<script>window.__pwned = 1</script>")'
    assert out.locator("ul > li").count() == 3 and out.locator("ul ul > li").text_content() == "nested"
    assert out.locator("ol > li").count() == 2
    link = out.locator("a")
    assert link.count() == 1 and link.get_attribute("href") == "https://example.com/docs"
    assert link.get_attribute("rel") == "noopener noreferrer nofollow" and link.get_attribute("target") == "_blank"
    assert "[bad](javascript:window.__pwned=1)" in out.text_content()
    assert '<img src=x onerror="window.__pwned=1"><script>' in out.text_content()
    assert page.evaluate("document.querySelectorAll('#messages img, #messages script').length") == 0
    assert page.evaluate("typeof window.__pwned") == "undefined", "model output ran as code"
    out.locator("button.copy").click()
    page.locator("button.copy", has_text="Copied").wait_for()
    assert page.evaluate("navigator.clipboard.readText()") == 'print("<script>window.__pwned = 1</script>")'
    send(page, "Thanks")  # the history carries the answer as the model wrote it, not as rendered
    answer_of(page, 1)
    assert bodies[1]["messages"][1] == {"role": "assistant", "content": MARKDOWN}
    page.context.close()


ICON_PIXELS = """async (src) => {  // the icon at src drawn on a 32 x 32 canvas: its RGBA bytes
  const img = new Image();
  img.src = src;
  await img.decode();
  const canvas = document.createElement("canvas");
  canvas.width = canvas.height = 32;
  const ctx = canvas.getContext("2d");
  ctx.drawImage(img, 0, 0, 32, 32);
  return Array.from(ctx.getImageData(0, 0, 32, 32).data);
}"""


def test_page_loads_without_console_errors_and_has_an_icon(browser, server):
    """The first load, key already stored, logs no console error (a 404 for /favicon.ico was one)."""
    stored = {"cookies": [], "origins": [{"origin": server.url,
                                          "localStorage": [{"name": "bestiary-chat:api_key", "value": KEY}]}]}
    page = browser.new_context(storage_state=stored).new_page()
    errors = console_errors(page)
    page.goto(server.url + "/")
    wait_for_models(page)
    page.wait_for_load_state("networkidle")
    time.sleep(0.5)  # the browser asks for an icon after the load
    assert errors == []
    icon = httpx.get(f"{server.url}/favicon.ico", timeout=30)
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
    assert icon.content[:4] == b"\x00\x00\x01\x00" and icon.content[22:30] == b"\x89PNG\r\n\x1a\n"  # ICO of a PNG
    svg = page.get_attribute("link[rel=icon]", "href")
    assert svg.startswith("data:image/svg+xml,")
    ico, drawn = page.evaluate(ICON_PIXELS, "/favicon.ico"), page.evaluate(ICON_PIXELS, svg)
    assert sum(ico[3::4]) > 0.8 * 255 * 32 * 32  # the rounded square covers most of it
    assert sum(abs(a - b) for a, b in zip(ico, drawn)) / len(ico) < 4  # the same icon as the page's SVG
    page.context.close()
