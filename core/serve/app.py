"""The FastAPI app: OpenAI's routes on one `LLM`, auth, errors in OpenAI's shape, metrics.

    GET  /health                 200 {"status": "ok"} (no key needed)
    GET  /metrics                Prometheus text (no key needed)
    GET  /                       the web chat page (core/serve/static, core.serve.web)
    GET  /v1/models              the served model and its LoRA adapters (--lora_modules)
    POST /v1/completions         text (or ids) -> text; stream: server-sent events
    POST /v1/chat/completions    messages -> chat template -> text
    POST /v1/embeddings          inputs -> pooled, normalised hidden states (core.serve.embeddings)
    POST /tokenize, /detokenize  text or messages <-> token ids (vLLM's shapes; core.serve.tokenize)

Errors: {"error": {"message", "type", "param", "code"}} with 400 (a bad parameter, named;
a prompt longer than max_input_len, or prompt + max_tokens past the context), 401 (missing or
wrong key), 404 (unknown model or route), 413 (a body over --max_request_bytes), 503 (more than
max_queue_len requests wait for their first token), 500 (a bug: logged, counted, in this shape).
A client that disconnects cancels its request: waiting, generating or streaming.

This module assembles the app; each resource's routes live in their own module: `health`
(/health, /metrics), `web` (the chat page), `model_list` (/v1/models), `completions` (both
generating routes); `errors` has the error shape and its handlers, `settings` ServeSettings.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.llm import LLM
from bestiary.core.serve.completions import Completions, completions_router
from bestiary.core.serve.embeddings import embeddings_router
from bestiary.core.serve.errors import APIError, add_error_handlers
from bestiary.core.serve.health import health_router
from bestiary.core.serve.metrics import ServerMetrics
from bestiary.core.serve.model_list import models_router
from bestiary.core.serve.settings import ServeSettings
from bestiary.core.serve.tokenize import tokenize_router
from bestiary.core.serve.web import web_router

__all__ = ["APIError", "AuthAndCount", "ServeSettings", "create_app", "load_chat_template"]

log = logging.getLogger("bestiary.serve")


class AuthAndCount:
    """ASGI middleware: 401 on /v1/* without the API key (when one is set); every answer counted by
    endpoint and status (bestiary_requests_total), 500s included: an exception no route handled is
    answered here, in OpenAI's shape (500, type server_error), logged once, and counted.

    Plain ASGI (not starlette's BaseHTTPMiddleware, which pipes every streamed chunk through an
    extra task and stream)."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app, self.key, self.metrics = app, api_key, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = endpoint_label(path)
        if (self.key is not None and path.startswith(KEYED)
                and dict(scope["headers"]).get(b"authorization") != f"Bearer {self.key}".encode()):
            self.metrics.requests.labels(endpoint, "401").inc()
            response = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                                code="invalid_api_key").response()
            await response(scope, receive, send)
            return
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception as err:  # noqa: BLE001 - a bug: answered (or the stream ended) and logged, never a hang
            log.error("internal error on %s %s: %s: %s", scope.get("method"), path, type(err).__name__, err,
                      exc_info=err)
            if started:  # a stream already sent its status: the connection just ends
                return
            message = f"internal error: {type(err).__name__}: {str(err)[:200]}"
            await APIError(500, message, code="internal_error", kind="server_error").response()(
                scope, receive, counting_send)


ROUTES = frozenset({"/", "/health", "/metrics", "/favicon.ico", "/v1/models", "/v1/completions",
                    "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"})
KEYED = ("/v1/", "/tokenize", "/detokenize")  # what --api_key guards


def endpoint_label(path: str) -> str:
    """The metrics' endpoint label of a path: a route's own path, /static, or `other` (so a client
    sending random paths cannot grow the number of series without bound)."""
    if path in ROUTES:
        return path
    return "/static" if path.startswith("/static/") else "other"


def create_app(llm: LLM, settings: ServeSettings) -> FastAPI:
    """The app serving `llm` under `settings.served_model_name`: every resource's routes, auth, errors."""
    app = FastAPI(title="bestiary", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(llm.executor)
    add_error_handlers(app)
    app.add_middleware(AuthAndCount, api_key=settings.api_key, metrics=metrics)
    app.include_router(health_router(metrics))
    app.include_router(web_router())
    app.include_router(models_router(settings, llm.engine.build.max_seq_len))
    handler = Completions(llm, settings, metrics)
    app.include_router(completions_router(handler))
    app.include_router(embeddings_router(handler))
    app.include_router(tokenize_router(handler))
    app.state.metrics = metrics
    app.state.started = time.time()
    return app


def load_chat_template(path: str) -> str:
    """The text of a --chat_template file (a jinja2 template; a .json file: its "chat_template")."""
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise BestiaryError(f"--chat_template {path}: no such file")
    text = file.read_text()
    if file.suffix == ".json":
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deeply
            expected = "expected a JSON object with a 'chat_template' string"
            raise BestiaryError(f"--chat_template {path}: {expected}") from None
    from bestiary.core.runtime.chat_template import compile_template

    compile_template(text, f"--chat_template {path}")  # a syntax error is named now, not at the first request
    return text
