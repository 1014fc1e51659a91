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

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text or "")
        self.ids += delta.token_ids
        self.log_probs += delta.log_probs or []
        self.top_log_probs += delta.top_log_probs or []
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.speculative = delta.speculative or self.speculative


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NO_LOG_PROB


class Formatter:
    """Response bodies of one request, for /v1/completions (chat=False) or /v1/chat/completions."""

    def __init__(self, llm: LLM, model: str, chat: bool, num_choices: int, prompt_tokens: int,
                 log_probs: bool) -> None:
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

    def logprobs(self, ids: list[int], log_probs: list[float], top: list[list[tuple[int, float]]]) -> dict | None:
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
                "top_logprobs": [{self._token(a): _finite(b) for a, b in alts} for alts in tops] if top else None,
                "text_offset": offsets}

    def response(self, choices: list[Choice]) -> dict:
        """The non-streaming body."""
        out = []
        for i, c in enumerate(choices):
            item: dict = {"index": i, "logprobs": self.logprobs(c.ids, c.log_probs, c.top_log_probs),
                          "finish_reason": c.finish_reason}
            text = "".join(c.text)
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            out.append(item)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": out, "usage": self.usage(sum(len(c.ids) for c in choices),
                                                    [c.speculative for c in choices])}

    def chunk(self, choices: list[dict], usage: dict | None = None, include_usage: bool = False) -> str:
        """One server-sent event with these choice deltas (and a usage field when asked for)."""
        body: dict = {"id": self.id, "object": f"{self.object}.chunk" if self.chat else self.object,
                      "created": self.created, "model": self.model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def delta_choice(self, index: int, delta: Delta) -> dict:
        item: dict = {"index": index, "logprobs": self.logprobs(delta.token_ids, delta.log_probs or [],
                                                                 delta.top_log_probs or []),
                      "finish_reason": delta.finish_reason}
        if self.chat:
            item["delta"] = {"content": delta.text or ""} if delta.text or delta.finish_reason is None else {}
        else:
            item["text"] = delta.text or ""
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


async def sse_events(first: tuple[int, Delta] | None, deltas: AsyncGenerator[tuple[int, Delta], None], fmt: Formatter,
                     timer: RequestTimer, include_usage: bool) -> AsyncIterator[str]:
    """The event stream: (chat: a role chunk per choice), a chunk per delta, (usage), [DONE].

    `first` is the delta already taken from `deltas` (the server waits for it before answering,
    so limit errors still get their status code). Closing this stream closes `deltas`. An error
    after the status was sent ends the stream with an event in OpenAI's error shape (as vLLM's),
    then [DONE]: `data: {"error": {"message", "type", "param", "code"}}`.
    """
    try:
        async for event in _delta_events(first, deltas, fmt, timer, include_usage):
            yield event
    except Exception as err:  # noqa: BLE001 - the status is sent: the client learns of it in the stream
        kind, code = ("invalid_request_error", None) if isinstance(err, BestiaryError) else ("server_error",
                                                                                             "internal_error")
        if kind == "server_error":
            log.error("internal error in a stream: %s: %s", type(err).__name__, err, exc_info=err)
        error = {"message": f"{str(err)[:300]}", "type": kind, "param": None, "code": code}
        yield f"data: {json.dumps({'error': error}, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        timer.done()
        await deltas.aclose()


async def _delta_events(first: tuple[int, Delta] | None, deltas: AsyncGenerator[tuple[int, Delta], None],
                        fmt: Formatter, timer: RequestTimer, include_usage: bool) -> AsyncIterator[str]:
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
                index, delta = await deltas.__anext__()
            except StopAsyncIteration:
                break
        timer.tokens_arrived(index, len(delta.token_ids))
        generated += len(delta.token_ids)
        if delta.speculative is not None:  # a sample's last delta
            speculative.append(delta.speculative)
        yield fmt.chunk([fmt.delta_choice(index, delta)], include_usage=include_usage)
    if include_usage:
        yield fmt.chunk([], usage=fmt.usage(generated, speculative), include_usage=True)
    yield "data: [DONE]\n\n"
