"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, and the app's handlers.

A bad parameter or body is a 400 naming the field; an unknown route a 404 (code "not_found");
every other starlette HTTP error keeps its status.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        """The JSON response with this error's status."""
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}  # a union member in a pydantic loc


def _field_path(loc: tuple[int | str, ...]) -> str | None:
    """`messages.0.content` of a pydantic loc: field names, list indices and dict keys, without the
    union members and validators pydantic puts in it (`str`, `list[int]`, `function-after[...]`, `TextPart`)."""
    kept = [str(p) for p in loc if isinstance(p, int) or p.isdigit() or (
        p.isidentifier() and p.islower() and p not in TYPE_TAGS and p != "body")]
    return ".".join(kept) or None


def _specific(error: dict) -> tuple[bool, int]:
    """How telling one of pydantic's errors is: a Unicode error first (a text field's, whichever member of a
    union reported it), then the union member that got deepest into the value (max() keeps the earliest)."""
    unicode = error.get("type") == "string_unicode" or "surrogate" in str(error.get("msg", ""))
    return unicode, len(error.get("loc", ()))


def validation_error_of(errors: list) -> APIError:
    """400 naming the first bad field of pydantic's `errors()` (or saying the body is not JSON)."""
    first = max(errors, key=_specific)
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    param = _field_path(tuple(first.get("loc", ())))
    what = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        what = "unrecognized request argument"
    elif first.get("type") == "missing":
        what = "required"
    elif first.get("type") == "finite_number":
        what = "expected a finite number"
    elif first.get("type") == "string_unicode":
        what = "invalid Unicode: a lone surrogate"
    return APIError(400, f"{param}: {what}" if param else f"request body: {what}", param=param)


def validation_error(err: RequestValidationError) -> APIError:
    """400 naming the first bad field of a request FastAPI validated."""
    return validation_error_of(list(err.errors()))


def add_error_handlers(app: FastAPI) -> None:
    """Answer APIError, invalid requests and starlette's HTTP errors (404, 405, ...) in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if err.status_code == 404 else None
        return APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", code=code).response()
