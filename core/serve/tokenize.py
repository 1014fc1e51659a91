"""POST /tokenize and POST /detokenize (vLLM's shapes; under --api_key like /v1/*).

    /tokenize    {"prompt": text, "add_special_tokens": true} or {"messages": [...], "add_generation_prompt":
                 true, "add_special_tokens": false} (the chat template applied), "return_token_strs"
                 -> {"count", "max_model_len", "tokens": [ids], "token_strs": [vocabulary strings] | null}
    /detokenize  {"tokens": [ids]} -> {"prompt": text} (special tokens kept: a round trip gives the ids back)

`model`, when given, must name the served model (404 otherwise). Tokenizing runs off the event loop.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.tokenizer import Tokenizer
from bestiary.core.serve.completions import Completions
from bestiary.core.serve.errors import APIError
from bestiary.core.serve.protocol import DetokenizeRequest, TokenizeRequest
from bestiary.core.serve.request_body import request_json
from bestiary.core.serve.tools import template_messages


def tokenizer_of(checks: Completions, model: str | None) -> Tokenizer:
    """The engine's tokenizer (400 without one); 404 for a model that is not served."""
    if model is not None:
        checks.check_model(model)
    if checks.llm.tokenizer is None:
        raise APIError(400, "this engine has no tokenizer")
    return checks.llm.tokenizer


def tokenize_ids(checks: Completions, body: TokenizeRequest) -> list[int]:
    """The ids of the body's prompt or messages (in a worker thread)."""
    tokenizer = tokenizer_of(checks, body.model)
    if body.prompt is not None:
        checks.check_text_length(len(body.prompt.encode("utf-8")), "prompt")
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    messages = template_messages(body.messages or [], tokenizer.chat_template, checks.settings.tool_parser)
    checks.check_messages_length(messages)
    try:
        text = tokenizer.apply_chat_template(messages, body.add_generation_prompt)
    except BestiaryError as err:
        raise APIError(400, f"messages: {err}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


async def tokenize(checks: Completions, request: Request) -> JSONResponse:
    body = await request_json(request, TokenizeRequest, checks.settings.max_request_bytes)
    ids = await asyncio.to_thread(tokenize_ids, checks, body)
    strs = checks.llm.tokenizer.token_strs(ids) if body.return_token_strs and checks.llm.tokenizer else None
    return JSONResponse({"count": len(ids), "max_model_len": checks.max_seq_len, "tokens": ids, "token_strs": strs})


async def detokenize(checks: Completions, request: Request) -> JSONResponse:
    body = await request_json(request, DetokenizeRequest, checks.settings.max_request_bytes)
    tokenizer = tokenizer_of(checks, body.model)
    vocab = checks.llm.engine.config.vocab_size
    outside = next((t for t in body.tokens if t >= vocab), None)
    if outside is not None:
        raise APIError(400, f"tokens: id {outside} is outside the vocabulary [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text})


def tokenize_router(checks: Completions) -> APIRouter:
    """POST /tokenize and POST /detokenize on the served model's tokenizer."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        return await tokenize(checks, request)

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        return await detokenize(checks, request)

    return router
