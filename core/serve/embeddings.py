"""POST /v1/embeddings (OpenAI's shape): inputs -> the served model's pooled, normalised hidden states.

    request   {"model", "input": text | [texts] | [ids] | [[ids]], "encoding_format": "float" | "base64",
               "dimensions" (only the model's own hidden size)}
    response  {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}], "model",
               "usage": {"prompt_tokens", "total_tokens"}}

Each input is an embedding request on the executor (LLM.embed_async): it runs in the in-flight batch
beside generating requests. base64 is the float32 little-endian bytes (what the openai client
decodes). The pooling (last token or mean) is the server's --pooling, else the model's default.
"""

from __future__ import annotations

import asyncio
import base64

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from bestiary.core.format.errors import BestiaryError
from bestiary.core.serve.completions import ClientGone, Completions, TimedOut, until_disconnected
from bestiary.core.serve.errors import APIError
from bestiary.core.serve.metrics import RequestTimer
from bestiary.core.serve.protocol import EmbeddingRequest
from bestiary.core.serve.request_body import request_json


def encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: a list of floats, or base64 of its float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def all_embeddings(checks: Completions, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every prompt's embedding; the first failure cancels the others (their requests dropped)."""
    pooling = checks.settings.pooling
    tasks = [asyncio.ensure_future(checks.llm.embed_async(p, pooling)) for p in prompts]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def embeddings(checks: Completions, request: Request) -> Response:
    """POST /v1/embeddings."""
    body = await request_json(request, EmbeddingRequest, checks.settings.max_request_bytes)
    if checks.check_model(body.model) is not None:
        raise APIError(400, f"model {body.model!r}: embeddings of a LoRA adapter are not supported; name the base "
                            f"model {checks.settings.served_model_name!r}", param="model")
    size = checks.llm.engine.config.hidden_size
    if body.dimensions is not None and body.dimensions != size:
        raise APIError(400, f"dimensions: this model's embeddings have {size} dimensions and cannot be shortened",
                       param="dimensions")
    prompts = [await asyncio.to_thread(checks.encode, p, "input") for p in body.inputs()]
    for p in prompts:
        checks.check_prompt(p, "input")
    checks.check_queue()
    timer = RequestTimer(checks.metrics, sum(map(len, prompts)))
    try:
        vectors = await until_disconnected(request, all_embeddings(checks, prompts), checks.deadline())
    except BestiaryError as err:
        raise APIError(400, f"input: {err}", param="input") from None
    except ClientGone:
        return Response(status_code=499)
    except TimedOut:
        raise checks.timed_out() from None
    finally:
        timer.done()
    tokens = sum(map(len, prompts))
    data = [{"object": "embedding", "index": i, "embedding": encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": body.model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def embeddings_router(checks: Completions) -> APIRouter:
    """POST /v1/embeddings with the generating routes' checks (model, limits, queue)."""
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Response:
        return await embeddings(checks, request)

    return router
