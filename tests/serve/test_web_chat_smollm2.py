"""The web chat page on SmolLM2-135M-Instruct (slow suite): a two-turn conversation whose streamed
answers equal the API's greedy answers to the same history.

`BESTIARY_SAVE_SCREENSHOTS=1` saves the page's screenshots to docs/img/ (docs/serving.md's figures).
"""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from web_browser import answer_of, chromium, figure_dir, open_chat, screenshot, send, set_sampling  # noqa: E402

from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine  # noqa: E402
from bestiary.core.serve.process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
TURNS = ["What is the capital of France?", "And what is the capital of Italy?"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_fp32_checkpoint):
    """An engine of the session's fp32 checkpoint (tests/conftest.py) with this module's limits."""
    base = tmp_path_factory.mktemp("smollm2-chat")
    return build_engine(smollm2_fp32_checkpoint, base / "engine", BuildConfig(max_batch_size=4, max_seq_len=1024))


def test_web_chat_two_turns_equal_the_api(engine, tmp_path):
    with ServerProcess(engine, "--served_model_name", "SmolLM2-135M-Instruct", log=tmp_path / "server.log") as server, \
            chromium() as browser:
        page = open_chat(browser, server.url, timeout_ms=120_000, viewport={"width": 900, "height": 640})
        set_sampling(page, 0, NEW_TOKENS)
        page.click("#settings-toggle")  # closed again, as a user would
        history: list[dict] = []
        for text in TURNS:
            send(page, text)
            history.append({"role": "user", "content": text})
            answer = answer_of(page, len(history) // 2)
            body = {"model": "SmolLM2-135M-Instruct", "messages": history, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "top_p": 1}
            expected = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300).json()
            assert answer == expected["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": answer})
        screenshot(page, figure_dir(tmp_path) / "web-chat.png")
        page.context.close()
        phone = open_chat(browser, server.url, timeout_ms=120_000, viewport={"width": 375, "height": 667},
                          is_mobile=True, has_touch=True)
        set_sampling(phone, 0, NEW_TOKENS)
        phone.click("#settings-toggle")
        send(phone, TURNS[0])
        answer_of(phone, 0)
        screenshot(phone, figure_dir(tmp_path) / "web-chat-phone.png")
        phone.context.close()
