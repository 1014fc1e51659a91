"""The generating routes: POST /v1/completions and POST /v1/chat/completions.

Both check the request against the engine's limits (400 naming the parameter; 404 for an
unknown model; 503 when more than max_queue_len requests wait for a first token), then answer
with one JSON body or, with `stream`, server-sent events (core.serve.generation). A client that
disconnects cancels its request: waiting, generating or streaming (499 in the metrics).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.request import LoraRequest
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.core.serve.errors import APIError
from bestiary.core.serve.generation import Formatter, choice_deltas, collect, sse_events
from bestiary.core.serve.metrics import RequestTimer, ServerMetrics
from bestiary.core.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from bestiary.core.serve.settings import ServeSettings

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
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


async def _first(deltas: AsyncIterator[T]) -> T | None:
    """The first item of `deltas` (None if it has none)."""
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        return None


class Completions:
    """Checks requests against one LLM's limits and the server's settings, and answers them."""

    def __init__(self, llm: LLM, settings: ServeSettings, metrics: ServerMetrics) -> None:
        self.llm, self.settings, self.metrics = llm, settings, metrics
        build = llm.engine.build
        # Engine.load fills both limits (core.format.build_config.finalize_build_config).
        assert build.max_input_len is not None and build.max_seq_len is not None, "the engine's limits are not final"
        self.max_input_len, self.max_seq_len, self.max_batch_size = (build.max_input_len, build.max_seq_len,
                                                                     build.max_batch_size)

    def check_model(self, name: str) -> LoraRequest | None:
        """The adapter a model name runs with (None: the base model); 404 for an unknown name."""
        settings = self.settings
        if name == settings.served_model_name:
            return None
        if name in settings.lora_modules:
            return LoraRequest(name, settings.lora_modules[name])
        served = [settings.served_model_name, *settings.lora_modules]
        raise APIError(404, f"model {name!r} does not exist; this server serves {', '.join(map(repr, served))}",
                       param="model", code="model_not_found")

    def check_prompt(self, ids: list[int], param: str) -> None:
        """400 for an empty prompt or one longer than the engine's max_input_len."""
        if len(ids) > self.max_input_len:
            raise APIError(400, f"{param}: {len(ids)} tokens exceed the engine's max_input_len {self.max_input_len}",
                           param=param, code="context_length_exceeded")
        if not ids:
            raise APIError(400, f"{param}: empty prompt", param=param)

    def check_queue(self) -> None:
        """503 when max_queue_len requests already wait for their first token."""
        if self.metrics.num_waiting >= self.settings.max_queue_len:
            raise APIError(503, f"server busy: {self.settings.max_queue_len} requests are waiting (--max_queue_len)",
                           code="queue_full", kind="server_error")

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (a text needs the engine's tokenizer)."""
        if isinstance(prompt, list):
            return prompt
        if self.llm.tokenizer is None:
            raise APIError(400, "prompt: this engine has no tokenizer; send token ids", param="prompt")
        return self.llm.tokenizer.encode(prompt)

    def vocab_check(self, bias: dict[int, float] | None) -> None:
        """400 for a logit_bias token outside the vocabulary."""
        vocab = self.llm.engine.config.vocab_size
        bad = [t for t in bias or {} if t >= vocab]
        if bad:
            raise APIError(400, f"logit_bias: token {bad[0]} is outside the vocabulary [0, {vocab})",
                           param="logit_bias")

    def build_sampling(self, body: SamplingRequest, max_new_tokens: int, top_log_probs: int | None) -> SamplingConfig:
        """The request's SamplingConfig; 400 for what the engine cannot do or the config refuses."""
        if body.n > self.max_batch_size:
            raise APIError(400, f"n: {body.n} exceeds the engine's max_batch_size {self.max_batch_size}", param="n")
        if body.stop and self.llm.tokenizer is None:
            raise APIError(400, "stop: this engine has no tokenizer", param="stop")
        if top_log_probs is not None and self.llm.tokenizer is None:
            raise APIError(400, "logprobs: this engine has no tokenizer to spell the tokens", param="logprobs")
        try:
            return body.sampling(max_new_tokens, top_log_probs)
        except ValidationError as err:
            first = err.errors()[0]
            raise APIError(400, f"sampling: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None

    async def answer(self, request: Request, body: SamplingRequest, prompts: list[list[int]], fmt: Formatter,
                     sampling: SamplingConfig, lora: LoraRequest | None) -> Response:
        """Generate and answer: one JSON body, or (body.stream) an event stream once the first delta is in."""
        timer = RequestTimer(self.metrics, sum(len(p) for p in prompts))
        deltas = choice_deltas(self.llm, prompts, sampling, lora)
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

    async def completion(self, request: Request, body: CompletionRequest) -> Response:
        """POST /v1/completions: text (or ids) -> text."""
        lora = self.check_model(body.model)
        prompts = [self.encode(p) for p in body.prompts()]
        for p in prompts:
            self.check_prompt(p, "prompt")
        self.vocab_check(body.logit_bias)
        self.check_queue()
        sampling = self.build_sampling(body, body.token_limit, body.logprobs)
        fmt = Formatter(self.llm, body.model, False, len(prompts) * body.n, sum(map(len, prompts)),
                        body.logprobs is not None)
        return await self.answer(request, body, prompts, fmt, sampling, lora)

    async def chat_completion(self, request: Request, body: ChatCompletionRequest) -> Response:
        """POST /v1/chat/completions: messages -> chat template -> text."""
        lora = self.check_model(body.model)
        messages = [m.as_template_message() for m in body.messages]
        try:
            ids = self.llm.chat_ids(messages, body.add_generation_prompt)
        except BestiaryError as err:
            raise APIError(400, f"messages: {err}", param="messages") from None
        self.check_prompt(ids, "messages")
        self.vocab_check(body.logit_bias)
        self.check_queue()
        limit = body.token_limit or max(self.max_seq_len - len(ids), 1)
        sampling = self.build_sampling(body, limit, body.top_log_probs)
        fmt = Formatter(self.llm, body.model, True, body.n, len(ids), body.logprobs)
        return await self.answer(request, body, [ids], fmt, sampling, lora)


def completions_router(llm: LLM, settings: ServeSettings, metrics: ServerMetrics) -> APIRouter:
    """POST /v1/completions and POST /v1/chat/completions on `llm`."""
    handler = Completions(llm, settings, metrics)
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await handler.completion(request, body)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await handler.chat_completion(request, body)

    return router

