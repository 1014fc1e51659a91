"""One HTTP request's generation: its prompts x n samples as OpenAI choices, streamed or collected.

Choice i * n + j is sample j of prompt i (OpenAI's order). Every prompt runs as one
`LLM.generate_async` call; their deltas are merged as they come. Log probs of tokens that
top-k / top-p filtered out are -inf, sent as -9999.0 (OpenAI's convention; JSON has no -inf).

A server that decodes speculatively (`bestiary serve --speculative`) adds the request's
acceptance counts to `usage` (summed over its choices), an extension that OpenAI's clients keep
as an extra field (`usage.model_extra["speculative"]` in the `openai` package):

    "speculative": {"steps": S, "drafted_tokens": D, "accepted_tokens": A, "acceptance_rate": A / D}

steps: verification forwards that checked at least one draft; acceptance_rate 0 when D = 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass, field

from bestiary.core.format.errors import BestiaryError
from bestiary.core.lora.request import LoraRequest
from bestiary.core.runtime.llm import LLM, Delta
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.core.runtime.speculative import AcceptanceStats
from bestiary.core.serve.metrics import RequestTimer
from bestiary.core.serve.tool_calls import ToolCallDeltas, new_call_id, parse, tool_calls_json

NO_LOG_PROB = -9999.0
log = logging.getLogger("bestiary.serve")


async def choice_deltas(llm: LLM, prompts: list[list[int]], sampling: SamplingConfig,
                        lora: LoraRequest | None = None) -> AsyncGenerator[tuple[int, Delta], None]:
    """(choice index, delta) of every sample of every prompt (with adapter `lora`), in arrival order.

    Limit errors (BestiaryError) come out of the first iteration; closing the iterator cancels
    every prompt's request (their KV blocks are freed).
    """
    if len(prompts) == 1:
        async with contextlib.aclosing(llm.generate_async(prompts[0], sampling, lora=lora)) as stream:
            async for delta in stream:
                yield delta.index, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, ids: list[int]) -> None:
        try:
            async for delta in llm.generate_async(ids, sampling, lora=lora):
                queue.put_nowait((i * sampling.n + delta.index, delta))
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(err)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, ids)) for i, ids in enumerate(prompts)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each prompt's request dropped before we return


@dataclass
class Choice:
    """What one sample produced so far."""

    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    speculative: AcceptanceStats | None = None  # on its last delta, when the server speculates
    prompt_log_probs: list[float | None] | None = None  # on its first delta, with echo and logprobs
    prompt_top: list[list[tuple[int, float]] | None] | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text or "")
        self.ids += delta.token_ids
        self.log_probs += delta.log_probs or []
        self.top_log_probs += delta.top_log_probs or []
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.speculative = delta.speculative or self.speculative
        if delta.prompt_log_probs is not None:
            self.prompt_log_probs, self.prompt_top = delta.prompt_log_probs, delta.prompt_top_log_probs


def _finite(value: float | None) -> float | None:
    """A log prob JSON can hold: -inf as NO_LOG_PROB; None (an echoed prompt's first token) stays null."""
    return value if value is None or math.isfinite(value) else NO_LOG_PROB


@dataclass
class Echo:
    """What /v1/completions' `echo` puts before each choice: its prompt's text and ids; `drop_output`:
    max_tokens 0, the prompt (and its log probs) alone."""

    prompts: list[tuple[str, list[int]]]  # per prompt: (text, ids)
    samples: int  # choices per prompt (n)
    drop_output: bool = False
    done: set[int] = field(default_factory=set)  # streamed choices whose prompt was sent

    def prefix(self, index: int, log_probs: list[float | None] | None, top: list | None
               ) -> tuple[str, list[int], list[float | None], list]:
        """(text, ids, log probs, top alternatives) of choice `index`'s prompt (log probs None if not asked)."""
        text, ids = self.prompts[index // self.samples]
        return text, ids, log_probs or [None] * len(ids), top or [None] * len(ids)


class Formatter:
    """Response bodies of one request, for /v1/completions (chat=False) or /v1/chat/completions."""

    def __init__(self, llm: LLM, model: str, chat: bool, num_choices: int, prompt_tokens: int,
                 log_probs: bool, echo: Echo | None = None, tool_parser: str | None = None) -> None:
        self.echo = echo
        self.tool_parser = tool_parser  # chat with tools: the answers' tool call format (core.serve.tool_calls)
        self.tool_streams: dict[int, ToolCallDeltas] = {}  # streamed choice -> its parse so far
        self.llm = llm
        self.model = model
        self.chat = chat
        self.num_choices = num_choices
        self.prompt_tokens = prompt_tokens
        self.log_probs = log_probs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _token(self, token: int) -> str:
        """A token's text (log probs are asked for only of an engine with a tokenizer: core.serve.completions)."""
        assert self.llm.tokenizer is not None, "log probs need the engine's tokenizer"
        return self.llm.tokenizer.decode([token], skip_special_tokens=False)

    def usage(self, completion_tokens: int, speculative: Iterable[AcceptanceStats | None] = ()) -> dict:
        """OpenAI's usage object; with a speculating server, also the choices' acceptance counts summed."""
        usage: dict = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                       "total_tokens": self.prompt_tokens + completion_tokens}
        if self.llm.executor.speculator is not None:
            usage["speculative"] = speculative_usage(speculative)
        return usage

    def logprobs(self, ids: list[int], log_probs: list, top: list) -> dict | None:
        """OpenAI's logprobs object of these tokens (chat: content entries; completions: parallel lists)."""
        if not self.log_probs:
            return None
        ids = ids[: len(log_probs)]
        tops = top if top else [[] for _ in ids]
        if self.chat:
            def entry(t: int, lp: float) -> dict:
                text = self._token(t)
                return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode())}

            return {"content": [dict(entry(t, lp), top_logprobs=[entry(a, b) for a, b in alts])
                                for t, lp, alts in zip(ids, log_probs, tops)]}
        tokens = [self._token(t) for t in ids]
        offsets = [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [_finite(lp) for lp in log_probs],
                "top_logprobs": [None if alts is None else {self._token(a): _finite(b) for a, b in alts}
                                 for alts in tops] if top else None,
                "text_offset": offsets}

    def response(self, choices: list[Choice]) -> dict:
        """The non-streaming body."""
        out = []
        for i, c in enumerate(choices):
            text, ids, log_probs, top = self._with_echo(i, "".join(c.text), c.ids, c.log_probs, c.top_log_probs,
                                                        c.prompt_log_probs, c.prompt_top)
            item: dict = {"index": i, "logprobs": self.logprobs(ids, log_probs, top), "finish_reason": c.finish_reason}
            if self.chat:
                item["message"], item["finish_reason"] = self.message(text, c.finish_reason)
            else:
                item["text"] = text
            out.append(item)
        generated = 0 if self.echo is not None and self.echo.drop_output else sum(len(c.ids) for c in choices)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": out, "usage": self.usage(generated, [c.speculative for c in choices])}

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A chat choice's message and finish_reason: with tools, the calls parsed out of its text (content
        None when only calls were written; "tool_calls" for an answer that ended by itself with calls)."""
        if self.tool_parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = parse(text, self.tool_parser)
        if not parsed.calls:
            return {"role": "assistant", "content": parsed.content}, finish_reason
        calls = tool_calls_json(parsed.calls, [new_call_id() for _ in parsed.calls])
        content = parsed.content if parsed.content.strip() else None
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                "tool_calls" if finish_reason == "stop" else finish_reason)

    def _with_echo(self, index: int, text: str, ids: list[int], log_probs: list, top: list,
                   prompt_log_probs: list | None, prompt_top: list | None) -> tuple[str, list[int], list, list]:
        """A choice's text, ids and log probs with its prompt's before them (echo); the output dropped with
        max_tokens 0. Without echo, as they are."""
        if self.echo is None:
            return text, ids, log_probs, top
        if self.echo.drop_output:
            text, ids, log_probs, top = "", [], [], []
        p_text, p_ids, p_log_probs, p_top = self.echo.prefix(index, prompt_log_probs, prompt_top)
        top = p_top + (top or [[] for _ in ids]) if top or prompt_top else []
        return p_text + text, p_ids + ids, p_log_probs + log_probs, top

    def chunk(self, choices: list[dict], usage: dict | None = None, include_usage: bool = False) -> str:
        """One server-sent event with these choice deltas (and a usage field when asked for)."""
        body: dict = {"id": self.id, "object": f"{self.object}.chunk" if self.chat else self.object,
                      "created": self.created, "model": self.model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def delta_choices(self, index: int, delta: Delta) -> list[dict]:
        """The choice deltas of one generated delta: one, or (chat with tools) what its text adds to the
        content and the calls, OpenAI's way (a call's first delta has its id, type and name, then argument
        fragments), the log probs on the first and the finish_reason on the last."""
        if self.tool_parser is None:
            return [self.delta_choice(index, delta)]
        stream = self.tool_streams.setdefault(index, ToolCallDeltas(self.tool_parser))
        pieces = stream.push(delta.text or "", final=delta.finish_reason is not None)
        logprobs = self.logprobs(delta.token_ids, delta.log_probs or [], delta.top_log_probs or [])
        if not pieces and delta.finish_reason is None and logprobs is None:
            return []
        items: list[dict] = [{"index": index, "delta": piece, "logprobs": None, "finish_reason": None}
                             for piece in pieces or [{}]]
        items[0]["logprobs"] = logprobs
        finish = delta.finish_reason
        items[-1]["finish_reason"] = "tool_calls" if finish == "stop" and stream.called else finish
        return items

    def delta_choice(self, index: int, delta: Delta) -> dict:
        text, ids, log_probs, top = delta.text or "", delta.token_ids, delta.log_probs or [], delta.top_log_probs or []
        if self.echo is not None and index not in self.echo.done:  # the choice's first chunk: its prompt first
            self.echo.done.add(index)
            text, ids, log_probs, top = self._with_echo(index, text, ids, log_probs, top, delta.prompt_log_probs,
                                                        delta.prompt_top_log_probs)
        elif self.echo is not None and self.echo.drop_output:
            text, ids, log_probs, top = "", [], [], []
        item: dict = {"index": index, "logprobs": self.logprobs(ids, log_probs, top),
                      "finish_reason": delta.finish_reason}
        if self.chat:
            item["delta"] = {"content": text} if text or delta.finish_reason is None else {}
        else:
            item["text"] = text
        return item


def speculative_usage(stats: Iterable[AcceptanceStats | None]) -> dict:
    """The `usage.speculative` object: steps, drafted and accepted tokens summed over `stats`
    (None: a choice without counts), acceptance_rate = accepted / drafted (0 without drafts)."""
    total = AcceptanceStats()
    for s in stats:
        if s is not None:
            total.add(s)
    return total.to_json()


async def collect(deltas: AsyncIterator[tuple[int, Delta]], num_choices: int, timer: RequestTimer) -> list[Choice]:
    """Every choice of the request, finished."""
    choices = [Choice() for _ in range(num_choices)]
    async for index, delta in deltas:
        timer.tokens_arrived(index, len(delta.token_ids))
        choices[index].add(delta)
    return choices


class TimedOut(Exception):
    """The request passed its deadline (--request_timeout)."""


async def sse_events(first: tuple[int, Delta] | None, deltas: AsyncGenerator[tuple[int, Delta], None], fmt: Formatter,
                     timer: RequestTimer, include_usage: bool, deadline: float | None = None) -> AsyncIterator[str]:
    """The event stream: (chat: a role chunk per choice), a chunk per delta, (usage), [DONE].

    `first` is the delta already taken from `deltas` (the server waits for it before answering,
    so limit errors still get their status code). Closing this stream closes `deltas`. An error
    after the status was sent ends the stream with an event in OpenAI's error shape (as vLLM's),
    then [DONE]: `data: {"error": {"message", "type", "param", "code"}}`.
    """
    try:
        async for event in _delta_events(first, deltas, fmt, timer, include_usage, deadline):
            yield event
    except Exception as err:  # noqa: BLE001 - the status is sent: the client learns of it in the stream
        kind, code = ("invalid_request_error", None) if isinstance(err, BestiaryError) else ("server_error",
                                                                                             "internal_error")
        if isinstance(err, TimedOut):
            kind, code, err = "timeout", "request_timeout", TimedOut("request timed out (--request_timeout); "
                                                                     "it was cancelled")
        elif kind == "server_error":
            log.error("internal error in a stream: %s: %s", type(err).__name__, err, exc_info=err)
        error = {"message": f"{str(err)[:300]}", "type": kind, "param": None, "code": code}
        yield f"data: {json.dumps({'error': error}, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        timer.done()
        await deltas.aclose()


async def _delta_events(first: tuple[int, Delta] | None, deltas: AsyncGenerator[tuple[int, Delta], None],
                        fmt: Formatter, timer: RequestTimer, include_usage: bool,
                        deadline: float | None) -> AsyncIterator[str]:
    """sse_events' chunks: role chunks, one per delta, usage, [DONE]."""
    generated, speculative = 0, []
    if fmt.chat:
        for i in range(fmt.num_choices):
            yield fmt.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], include_usage=include_usage)
    pending = [first] if first is not None else []
    while True:
        if pending:
            index, delta = pending.pop()
        else:
            try:
                index, delta = await _next_before(deltas, deadline)
            except StopAsyncIteration:
                break
        timer.tokens_arrived(index, len(delta.token_ids))
        generated += 0 if fmt.echo is not None and fmt.echo.drop_output else len(delta.token_ids)
        if delta.speculative is not None:  # a sample's last delta
            speculative.append(delta.speculative)
        for item in fmt.delta_choices(index, delta):
            yield fmt.chunk([item], include_usage=include_usage)
    if include_usage:
        yield fmt.chunk([], usage=fmt.usage(generated, speculative), include_usage=True)
    yield "data: [DONE]\n\n"


async def _next_before(deltas: AsyncGenerator[tuple[int, Delta], None], deadline: float | None) -> tuple[int, Delta]:
    """The next delta, or TimedOut once the monotonic `deadline` passes (the wait cancelled: closing
    `deltas` then drops the request)."""
    if deadline is None:
        return await deltas.__anext__()
    try:
        return await asyncio.wait_for(deltas.__anext__(), max(deadline - time.monotonic(), 0.0))
    except TimeoutError:
        raise TimedOut from None
