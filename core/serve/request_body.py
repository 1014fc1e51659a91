"""A request's JSON body: read within --max_request_bytes, parsed and validated off the event loop.

    size     Content-Length over the limit: 413 at once, before a byte of the body is read (a client
             sending `Expect: 100-continue`, as curl does for large bodies, never sends it); a chunked
             body is counted as it arrives and refused (413) the moment it passes the limit.
    parse    the body is read as JSON (a body nested too deeply is a 400, never a RecursionError)
             and validated against the route's schema in a worker thread, so a large body never
             stalls /health or the running streams.
    errors   400 naming the first bad field ("temperature: Input should be less than or equal to
             2"), or saying what the body is: empty, not JSON (with the Content-Type sent), not an
             object.

The Content-Type is not required to be application/json (`curl -d` sends a form type): a body that
parses as JSON is read as JSON whatever its type; one that does not names the type it was sent with.
"""

from __future__ import annotations

import asyncio
import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from bestiary.core.serve.errors import APIError, validation_error_of

M = TypeVar("M", bound=BaseModel)


def too_large(limit: int, size: int | None = None) -> APIError:
    """413 naming the limit (and the size, when the client declared it)."""
    what = f"{size} bytes, over" if size is not None else "over"
    return APIError(413, f"request body: {what} the server's limit of {limit} bytes (--max_request_bytes)",
                    code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _json(body: bytes, content_type: str) -> object:
    """The body's JSON value; 400 saying what the body is when it is empty, not JSON, or nested too deeply."""
    sent = f" (Content-Type: {content_type[:64]})" if content_type else ""
    if not body.strip():
        raise APIError(400, f"request body: empty; expected a JSON object{sent}", code="invalid_json")
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "request body: nested too deeply", code="invalid_json") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        hint = "" if "json" in content_type.lower() else "; send application/json"
        raise APIError(400, f"request body is not valid JSON{sent}: {str(err)[:200]}{hint}",
                       code="invalid_json") from None


def parse_body(schema: type[M], body: bytes, content_type: str) -> M:
    """`body` validated as `schema`; 400 naming the body's or the first bad field's problem.

    Python's JSON reader, not pydantic's: it reads the escape of a lone surrogate ("\\ud800"), which the
    schema's text fields then refuse naming the field, where pydantic's reader calls the body invalid."""
    value = _json(body, content_type)
    if not isinstance(value, dict):
        named = {"list": "an array", "str": "a string", "int": "a number", "float": "a number",
                 "bool": "a boolean", "NoneType": "null"}.get(type(value).__name__, type(value).__name__)
        raise APIError(400, f"request body: expected a JSON object, got {named}", code="invalid_json")
    try:
        return schema.model_validate(value)
    except ValidationError as err:
        raise validation_error_of(err.errors()) from None
    except RecursionError:  # a value nested deeper than Python's stack in a field typed `dict`
        raise APIError(400, "request body: nested too deeply", code="invalid_json") from None


async def request_json(request: Request, schema: type[M], limit: int) -> M:
    """The request's body as `schema`: read within `limit` bytes, then parsed in a worker thread."""
    body = await read_body(request, limit)
    content_type = request.headers.get("content-type", "")
    return await asyncio.to_thread(parse_body, schema, body, content_type)
