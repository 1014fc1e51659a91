"""The FastAPI app: OpenAI's routes on one `LLM`, auth, errors in OpenAI's shape, metrics.

    GET  /health                 200 {"status": "ok"} (no key needed)
    GET  /metrics                Prometheus text (no key needed)
    GET  /                       the web chat page (core/serve/static, core.serve.web)
    GET  /v1/models              the served model and its LoRA adapters (--lora_modules)
    POST /v1/completions         text (or ids) -> text; stream: server-sent events
    POST /v1/chat/completions    messages -> chat template -> text

Errors: {"error": {"message", "type", "param", "code"}} with 400 (a bad parameter, named;
a prompt longer than max_input_len), 401 (missing or wrong key), 404 (unknown model or
route), 503 (more than max_queue_len requests wait for their first token).
A client that disconnects cancels its request: waiting, generating or streaming.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.request import LoraRequest
from bestiary.core.runtime.llm import LLM
from bestiary.core.serve.generation import Formatter, choice_deltas, collect, sse_events
from bestiary.core.serve.metrics import RequestTimer, ServerMetrics
from bestiary.core.serve.protocol import ChatCompletionRequest, CompletionRequest
from bestiary.core.serve.web import add_web_routes


class ServeSettings(BaseModel):
    """What `bestiary serve` was started with (besides the engine)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field(description="The model id clients name (GET /v1/models).")
    api_key: str | None = Field(None, description="Required as 'Authorization: Bearer KEY' on /v1/* when set.")
    max_queue_len: int = Field(1024, ge=1, description="Requests that may wait for a first token; more get 503.")
    lora_modules: dict[str, str] = Field(default_factory=dict,
                                         description="LoRA adapters served as model names: name -> HF PEFT dir.")


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class ClientGone(Exception):
    """The client closed the connection before the answer."""


async def until_disconnected(request: Request, work: Awaitable):
    """The result of `work`, or ClientGone (and `work` cancelled) if the client disconnects first.

    uvicorn delivers http.disconnect to receive() once the body has been read.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        gone.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone
    return task.result()


class AuthAndCount:
    """ASGI middleware on /v1/*: 401 without the API key (when one is set); counts answers by status.

    Plain ASGI (not starlette's BaseHTTPMiddleware, which pipes every streamed chunk through an
    extra task and stream)."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app, self.key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.key is not None and dict(scope["headers"]).get(b"authorization") != f"Bearer {self.key}".encode():
            self.metrics.requests.labels(path, "401").inc()
            response = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                                code="invalid_api_key").response()
            await response(scope, receive, send)
            return

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _validation_error(err: RequestValidationError) -> APIError:
    """400 naming the first bad field (or saying the body is not JSON)."""
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    loc = [p for p in loc if not p.startswith(("function-", "list[", "str", "int", "TextPart"))]
    param = ".".join(loc) or None
    what = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        what = "unrecognized request argument"
    elif first.get("type") == "missing":
        what = "required"
    return APIError(400, f"{param}: {what}" if param else what, param=param)


def create_app(llm: LLM, settings: ServeSettings) -> FastAPI:
    """The app serving `llm` under `settings.served_model_name`."""
    app = FastAPI(title="bestiary", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(llm.executor)
    build = llm.engine.build

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return _validation_error(err).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if err.status_code == 404 else None
        return APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", code=code).response()

    app.add_middleware(AuthAndCount, api_key=settings.api_key, metrics=metrics)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    add_web_routes(app)

    @app.get("/v1/models")
    async def models() -> dict:
        base = settings.served_model_name
        cards = [{"id": base, "object": "model", "created": 0, "owned_by": "bestiary", "parent": None,
                  "max_model_len": build.max_seq_len}]
        cards += [{"id": name, "object": "model", "created": 0, "owned_by": "bestiary", "root": path, "parent": base,
                   "max_model_len": build.max_seq_len} for name, path in settings.lora_modules.items()]
        return {"object": "list", "data": cards}

    def check_model(name: str) -> LoraRequest | None:
        """The adapter a model name runs with (None: the base model); 404 for an unknown name."""
        if name == settings.served_model_name:
            return None
        if name in settings.lora_modules:
            return LoraRequest(name, settings.lora_modules[name])
        served = [settings.served_model_name, *settings.lora_modules]
        raise APIError(404, f"model {name!r} does not exist; this server serves {', '.join(map(repr, served))}",
                       param="model", code="model_not_found")

    def check_prompt(ids: list[int], param: str) -> None:
        if len(ids) > build.max_input_len:
            raise APIError(400, f"{param}: {len(ids)} tokens exceed the engine's max_input_len {build.max_input_len}",
                           param=param, code="context_length_exceeded")
        if not ids:
            raise APIError(400, f"{param}: empty prompt", param=param)

    def check_queue() -> None:
        if metrics.num_waiting >= settings.max_queue_len:
            raise APIError(503, f"server busy: {settings.max_queue_len} requests are waiting (--max_queue_len)",
                           code="queue_full", kind="server_error")

    def encode(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if llm.tokenizer is None:
            raise APIError(400, "prompt: this engine has no tokenizer; send token ids", param="prompt")
        return llm.tokenizer.encode(prompt)

    async def answer(request: Request, body, prompts: list[list[int]], fmt: Formatter, sampling,
                     lora: LoraRequest | None):
        timer = RequestTimer(metrics, sum(len(p) for p in prompts))
        deltas = choice_deltas(llm, prompts, sampling, lora)
        try:
            if body.stream:
                first = await until_disconnected(request, _first(deltas))
                return StreamingResponse(sse_events(first, deltas, fmt, timer, body.include_usage),
                                         media_type="text/event-stream")
            choices = await until_disconnected(request, collect(deltas, fmt.num_choices, timer))
            timer.done()
            return JSONResponse(fmt.response(choices))
        except BestiaryError as err:
            timer.done()
            raise APIError(400, str(err)) from None
        except ClientGone:
            timer.done()
            await deltas.aclose()
            return Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        lora = check_model(body.model)
        prompts = [encode(p) for p in body.prompts()]
        for p in prompts:
            check_prompt(p, "prompt")
        vocab_check(body.logit_bias)
        check_queue()
        sampling = build_sampling(body, body.max_tokens, body.logprobs)
        fmt = Formatter(llm, body.model, False, len(prompts) * body.n, sum(map(len, prompts)),
                        body.logprobs is not None)
        return await answer(request, body, prompts, fmt, sampling, lora)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        lora = check_model(body.model)
        messages = [m.as_template_message() for m in body.messages]
        try:
            ids = llm.chat_ids(messages, body.add_generation_prompt)
        except BestiaryError as err:
            raise APIError(400, f"messages: {err}", param="messages") from None
        check_prompt(ids, "messages")
        vocab_check(body.logit_bias)
        check_queue()
        limit = body.token_limit or max(build.max_seq_len - len(ids), 1)
        sampling = build_sampling(body, limit, body.top_log_probs)
        fmt = Formatter(llm, body.model, True, body.n, len(ids), body.logprobs)
        return await answer(request, body, [ids], fmt, sampling, lora)

    def vocab_check(bias: dict[int, float] | None) -> None:
        vocab = llm.engine.config.vocab_size
        bad = [t for t in bias or {} if t >= vocab]
        if bad:
            raise APIError(400, f"logit_bias: token {bad[0]} is outside the vocabulary [0, {vocab})",
                           param="logit_bias")

    def build_sampling(body, max_new_tokens: int, top_log_probs: int | None):
        if body.n > build.max_batch_size:
            raise APIError(400, f"n: {body.n} exceeds the engine's max_batch_size {build.max_batch_size}", param="n")
        if body.stop and llm.tokenizer is None:
            raise APIError(400, "stop: this engine has no tokenizer", param="stop")
        try:
            return body.sampling(max_new_tokens, top_log_probs)
        except ValidationError as err:
            first = err.errors()[0]
            raise APIError(400, f"sampling: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None

    app.state.metrics = metrics
    app.state.started = time.time()
    return app


async def _first(deltas: AsyncIterator):
    """The first item of `deltas` (None if it has none)."""
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        return None


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
        except (ValueError, KeyError, TypeError):
            raise BestiaryError(f"--chat_template {path}: expected a JSON object with a 'chat_template' string") from None
    from bestiary.core.runtime.chat_template import compile_template

    compile_template(text)  # a syntax error is named now, not at the first request
    return text
