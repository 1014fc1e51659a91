"""The generating routes: POST /v1/completions and POST /v1/chat/completions.

Both check the request against the engine's limits (400 naming the parameter; 404 for an
unknown model; 503 when more than max_queue_len requests wait for a first token), then answer
with one JSON body or, with `stream`, server-sent events (core.serve.generation). A client that
disconnects cancels its request: waiting, generating or streaming (499 in the metrics).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.request import LoraRequest
from bestiary.core.runtime.guided import GuidedConfig
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.core.serve.errors import APIError
from bestiary.core.serve.generation import Echo, Formatter, TimedOut, choice_deltas, collect, sse_events
from bestiary.core.serve.metrics import RequestTimer, ServerMetrics
from bestiary.core.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from bestiary.core.serve.request_body import request_json
from bestiary.core.serve.settings import ServeSettings
from bestiary.core.serve.tools import ToolPlan, plan_tools

T = TypeVar("T")
# SamplingConfig's field -> the request's (what build_sampling's errors name)
REQUEST_NAMES = {"random_seed": "seed", "max_new_tokens": "max_tokens", "min_length": "min_tokens",
                 "stop_strings": "stop", "embedding_bias": "logit_bias", "top_log_probs": "top_logprobs"}


class ClientGone(Exception):
    """The client closed the connection before the answer."""


async def until_disconnected(request: Request, work: Awaitable[T], deadline: float | None = None) -> T:
    """The result of `work`, or ClientGone (and `work` cancelled) if the client disconnects first, or
    TimedOut if the monotonic `deadline` (--request_timeout) passes first.

    uvicorn delivers http.disconnect to receive() once the body has been read.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    try:
        await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        timed_out = not task.done() and not gone.done()
    finally:
        for pending in (task, gone):
            pending.cancel()
        # the work unwinds before anything else touches what it iterated (closing a generator the
        # cancelled task is still inside raised "aclose(): asynchronous generator is already running")
        await asyncio.gather(task, gone, return_exceptions=True)
    if timed_out:
        raise TimedOut
    if task.cancelled():
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
        """400 for an empty prompt, one longer than the engine's max_input_len, or an id outside the vocabulary."""
        if len(ids) > self.max_input_len:
            raise APIError(400, f"{param}: {len(ids)} tokens exceed the engine's max_input_len {self.max_input_len}",
                           param=param, code="context_length_exceeded")
        if not ids:
            raise APIError(400, f"{param}: empty prompt", param=param)
        vocab = self.llm.engine.config.vocab_size
        outside = next((t for t in ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise APIError(400, f"{param}: token id {outside} is outside the vocabulary [0, {vocab})", param=param)

    def check_text_length(self, num_bytes: int, param: str) -> None:
        """400, before tokenizing, for a text too long to fit max_input_len whatever its tokens: a 20 MB body
        is refused at once instead of tokenized (a lower bound on its tokens: Tokenizer.min_tokens)."""
        tokenizer = self.llm.tokenizer
        if tokenizer is not None and tokenizer.min_tokens(num_bytes) > self.max_input_len:
            raise APIError(400, f"{param}: {num_bytes} bytes of text are more than the engine's max_input_len "
                                f"{self.max_input_len} tokens can hold", param=param, code="context_length_exceeded")

    def check_messages_length(self, messages: list[dict]) -> None:
        """check_text_length of a conversation's texts (the template only adds to them)."""
        self.check_text_length(sum(len(m["content"].encode("utf-8")) for m in messages), "messages")

    def check_context(self, prompt_len: int, max_tokens: int | None, min_tokens: int, param: str) -> None:
        """400 when prompt + max_tokens exceeds the engine's context (as vLLM), or min_tokens > max_tokens."""
        if max_tokens is None:
            return
        if prompt_len + max_tokens > self.max_seq_len:
            raise APIError(400, f"{param}: this model's maximum context length is {self.max_seq_len} tokens; "
                                f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, {max_tokens} "
                                "in the completion): reduce the prompt or the completion",
                           param=param, code="context_length_exceeded")
        if min_tokens > max_tokens:
            raise APIError(400, f"min_tokens: {min_tokens} is more than {param} {max_tokens}", param="min_tokens")

    def deadline(self) -> float | None:
        """The monotonic time a request accepted now must end by (--request_timeout), or None."""
        limit = self.settings.request_timeout
        return None if limit is None else time.monotonic() + limit

    def timed_out(self) -> APIError:
        """408 naming the limit: the request was cancelled and everything it held given back."""
        return APIError(408, f"request timed out after {self.settings.request_timeout:g} s (--request_timeout); "
                             "it was cancelled", code="request_timeout")

    def check_queue(self) -> None:
        """503 when max_queue_len requests already wait for their first token."""
        if self.metrics.num_waiting >= self.settings.max_queue_len:
            raise APIError(503, f"server busy: {self.settings.max_queue_len} requests are waiting (--max_queue_len)",
                           code="queue_full", kind="server_error")

    def encode(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """A prompt's token ids (a text needs the engine's tokenizer; called in a worker thread)."""
        if isinstance(prompt, list):
            return prompt
        if self.llm.tokenizer is None:
            raise APIError(400, f"{param}: this engine has no tokenizer; send token ids", param=param)
        self.check_text_length(len(prompt.encode("utf-8")), param)
        return self.llm.tokenizer.encode(prompt)

    def chat_ids(self, plan: ToolPlan, add_generation_prompt: bool) -> list[int]:
        """The conversation's token ids through the chat template, with the plan's tools (in a worker thread)."""
        self.check_messages_length(plan.messages)
        try:
            return self.llm.chat_ids(plan.messages, add_generation_prompt, plan.tools)
        except BestiaryError as err:
            raise APIError(400, f"messages: {err}", param="messages") from None

    def tool_plan(self, body: ChatCompletionRequest) -> tuple[ToolPlan, list[int]]:
        """The request's template input and output constraint (core.serve.tools, under --tool_parser) and its
        prompt's ids (in a worker thread)."""
        template = self.llm.tokenizer.chat_template if self.llm.tokenizer is not None else None
        plan = plan_tools(body, template, self.settings.tool_parser)
        return plan, self.chat_ids(plan, body.add_generation_prompt)

    async def check_guided(self, body: SamplingRequest, plan: ToolPlan | None = None) -> None:
        """400 naming the field, before anything is queued, for a constraint that does not compile: the
        request's response_format / guided_*, each tool's parameters, then the plan's grammar (compiled
        grammars are cached: the executor reuses them)."""
        checks: list[tuple[GuidedConfig, str]] = []
        if (answer := body.guided()) is not None:
            checks.append((answer, body.guided_param))
        if plan is not None and plan.parser is not None and isinstance(body, ChatCompletionRequest):
            checks += [(GuidedConfig(json_schema=t.function.parameters), f"tools.{i}.function.parameters")
                       for i, t in enumerate(body.tools or []) if t.function.parameters is not None]
            if plan.guided is not None and plan.guided is not answer:
                checks.append((plan.guided, "tool_choice" if body.tool_mode == "named" else "tools"))
        if not checks:
            return
        grammars = self.llm.executor.grammars
        if grammars is None:
            raise APIError(400, f"{checks[0][1]}: this engine has no tokenizer to constrain the output with",
                           param=checks[0][1])

        def compile_all() -> None:
            for config, param in checks:
                try:
                    grammars.check(config)
                except BestiaryError as err:
                    raise APIError(400, f"{param}: {err}", param=param) from None

        await asyncio.to_thread(compile_all)

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
        except ValidationError as err:  # what the request schema does not check (a combination of fields)
            first = err.errors()[0]
            field = REQUEST_NAMES.get(str(first["loc"][0]), str(first["loc"][0])) if first["loc"] else None
            what = str(first["msg"]).removeprefix("Value error, ")
            raise APIError(400, f"{field}: {what}" if field else what, param=field) from None

    async def answer(self, request: Request, body: SamplingRequest, prompts: list[list[int]], fmt: Formatter,
                     sampling: SamplingConfig, lora: LoraRequest | None) -> Response:
        """Generate and answer: one JSON body, or (body.stream) an event stream once the first delta is in.

        Whatever ends the request (an answer, a limit error, a hang-up, an exception anywhere) releases it:
        its waiting slot (the timer) and its KV blocks (closing `deltas` cancels the generation)."""
        timer = RequestTimer(self.metrics, sum(len(p) for p in prompts))
        deltas = choice_deltas(self.llm, prompts, sampling, lora)
        release = Release(timer, deltas)
        deadline = self.deadline()
        try:
            if body.stream:
                first = await until_disconnected(request, _first(deltas), deadline)
                events = sse_events(first, deltas, fmt, timer, body.include_usage, deadline)
                return ReleasingStreamingResponse(events, release, media_type="text/event-stream")
            choices = await until_disconnected(request, collect(deltas, fmt.num_choices, timer), deadline)
            return JSONResponse(fmt.response(choices))
        except BestiaryError as err:
            raise APIError(400, str(err)) from None
        except ClientGone:
            return Response(status_code=499)
        except TimedOut:
            raise self.timed_out() from None
        finally:
            if not body.stream or not release.handed_off:
                await release()

    async def completion(self, request: Request) -> Response:
        """POST /v1/completions: text (or ids) -> text."""
        body = await request_json(request, CompletionRequest, self.settings.max_request_bytes)
        lora = self.check_model(body.model)
        texts = body.prompts()
        prompts = [await asyncio.to_thread(self.encode, p) for p in texts]
        for p in prompts:
            self.check_prompt(p, "prompt")
            self.check_context(len(p), body.token_limit, body.min_tokens, "max_tokens")
        if body.token_limit == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 needs echo: true (the prompt alone, with its log probs)",
                           param="max_tokens")
        self.vocab_check(body.logit_bias)
        await self.check_guided(body)
        self.check_queue()
        sampling = self.build_sampling(body, max(body.token_limit, 1), body.logprobs)
        echo = None
        if body.echo:  # the prompt's log probs come from its context logits (core.runtime.prompt_log_probs)
            sampling = sampling.model_copy(update={"output_context_logits": body.logprobs is not None})
            echo = Echo([(t if isinstance(t, str) else self.spell(t), p) for t, p in zip(texts, prompts)], body.n,
                        drop_output=body.token_limit == 0)
        fmt = Formatter(self.llm, body.model, False, len(prompts) * body.n, sum(map(len, prompts)),
                        body.logprobs is not None, echo)
        return await self.answer(request, body, prompts, fmt, sampling, lora)

    def spell(self, ids: list[int]) -> str:
        """The text of a prompt given as ids (echo), special tokens kept; "" without a tokenizer."""
        tokenizer = self.llm.tokenizer
        return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=False)

    async def chat_completion(self, request: Request) -> Response:
        """POST /v1/chat/completions: messages -> chat template -> text."""
        body = await request_json(request, ChatCompletionRequest, self.settings.max_request_bytes)
        lora = self.check_model(body.model)
        plan, ids = await asyncio.to_thread(self.tool_plan, body)
        self.check_prompt(ids, "messages")
        limit_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        self.check_context(len(ids), body.token_limit, body.min_tokens, limit_name)
        self.vocab_check(body.logit_bias)
        await self.check_guided(body, plan)
        self.check_queue()
        limit = body.token_limit or max(self.max_seq_len - len(ids), 1)
        sampling = self.build_sampling(body, limit, body.top_log_probs).model_copy(update={"guided": plan.guided})
        fmt = Formatter(self.llm, body.model, True, body.n, len(ids), body.logprobs, tool_parser=plan.parser)
        return await self.answer(request, body, [ids], fmt, sampling, lora)


class Release:
    """Ends one request's hold on the server, once: its waiting slot and (closing its deltas) its KV blocks."""

    def __init__(self, timer: RequestTimer, deltas: AsyncGenerator) -> None:
        self.timer, self.deltas = timer, deltas
        self.handed_off = False  # a streaming response took the duty of calling this
        self.done = False

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.timer.done()
        await self.deltas.aclose()


class ReleasingStreamingResponse(StreamingResponse):
    """An event stream that releases its request however the response ends: sent, failed, or the client
    gone before the first byte (starlette then never starts the body iterator, whose own cleanup never runs)."""

    def __init__(self, content: AsyncIterator[str], release: Release, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        release.handed_off = True
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()


def completions_router(handler: Completions) -> APIRouter:
    """POST /v1/completions and POST /v1/chat/completions with `handler` (one LLM's checks and answers)."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handler.completion(request)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handler.chat_completion(request)

    return router
