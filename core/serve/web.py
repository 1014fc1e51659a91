"""The web chat page of `bestiary serve`: static HTML + JS + CSS shipped as package data.

    GET /                   static/index.html
    GET /static/{name}      chat.js, chat.css (nothing else; no build step, nothing from the internet)

The page talks to the same server's /v1/models and /v1/chat/completions (streamed); with
--api_key it asks for the key and keeps it in the browser's localStorage.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}
PAGE_FILES = ("chat.js", "chat.css")
# The page may load only its own files and talk only to this server.
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"


def static_text(name: str) -> str:
    """The text of a file of core/serve/static."""
    return resources.files("bestiary.core.serve").joinpath("static").joinpath(name).read_text(encoding="utf-8")


def web_router() -> APIRouter:
    """The chat page at / and its files under /static/."""
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache"}
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(static_text("index.html"), headers=headers)

    @router.get("/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in PAGE_FILES:
            return Response(f"GET /static/{name}: not found", status_code=404, media_type="text/plain")
        suffix = name[name.rindex("."):]
        return Response(static_text(name), media_type=MEDIA_TYPES[suffix], headers=headers)

    return router
