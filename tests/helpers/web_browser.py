"""Debian's chromium driven by Playwright (imported as `web_browser` by the browser tests).

The browser is the system's (`apt-get install chromium`: `make browser`, and .ci/run under
CI=true), never one Playwright downloads. Without it the browser tests skip, except under
CI=true, where a missing chromium or playwright fails them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# where BESTIARY_SAVE_SCREENSHOTS=1 puts the slow test's screenshots (docs/serving.md's figures)
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
INSTALL_HINT = "install chromium with `make browser` (apt-get) and playwright with `make install` (the test extra)"


def _missing(what: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing under CI=true; {INSTALL_HINT}")
    pytest.skip(f"{what} is missing; {INSTALL_HINT}")


def chromium_path() -> str:
    """The system chromium's executable (fails under CI=true, skips elsewhere, when there is none)."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    _missing("chromium")


def sync_playwright():
    """playwright.sync_api.sync_playwright (fails under CI=true, skips elsewhere, without playwright)."""
    try:
        from playwright.sync_api import sync_playwright as start
    except ImportError:
        _missing("the playwright package")
    return start


@contextmanager
def chromium() -> Iterator:
    """A headless Playwright Browser on the system's chromium."""
    executable = chromium_path()
    with sync_playwright()() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


# --- driving the chat page as a user would ------------------------------------------------

def open_chat(browser, url: str, key: str | None = None, timeout_ms: float = 30_000, **context_options):
    """The chat page at `url` in a fresh context (empty localStorage), models listed.

    With `key`: the page first meets a 401, opens its settings to ask for the key, and gets it.
    Close it with page.context.close().
    """
    page = browser.new_context(**context_options).new_page()
    page.set_default_timeout(timeout_ms)
    page.goto(url + "/")
    if key is not None:
        page.locator("#status", has_text="API key").wait_for()
        assert page.is_visible("#settings")
        page.fill("#api_key", key)
        page.dispatch_event("#api_key", "change")
    wait_for_models(page)
    return page



def wait_for_models(page) -> None:
    """Until the model picker has its options (no wait_for_function: the page's CSP forbids eval)."""
    page.locator("#model option").first.wait_for(state="attached")


def set_sampling(page, temperature: float, max_tokens: int) -> None:
    if page.is_hidden("#settings"):
        page.click("#settings-toggle")
    page.fill("#temperature", str(temperature))
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#top_p", "1")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def answer_of(page, index: int, state: str = "done") -> str:
    """The text of assistant message `index` once it reached `state` (done, stopped, error): the answer as
    the model wrote it (the Markdown source of what the page renders; data-source), or an error's text."""
    bubble = page.locator(".message.assistant").nth(index)
    bubble.and_(page.locator(f"[data-state={state}]")).wait_for()
    return bubble.locator(".text").evaluate("el => el.dataset.source ?? el.textContent")


def console_errors(page) -> list[str]:
    """A list that collects the page's console errors (a failed resource load is one) from now on."""
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    return errors


def figure_dir(tmp_path: Path) -> Path:
    """docs/img/ with BESTIARY_SAVE_SCREENSHOTS=1 (the docs' figures), else `tmp_path`."""
    return DOCS_IMG if os.environ.get("BESTIARY_SAVE_SCREENSHOTS") == "1" else tmp_path


def screenshot(page, path: Path) -> Path:
    """A full-page PNG of `page` at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path
