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


def validation_error(err: RequestValidationError) -> APIError:
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
