"""The web chat page of `bestiary serve`: static HTML + JS + CSS shipped as package data.

    GET /                   static/index.html (its icon: an inline SVG data: URL)
    GET /static/{name}      markdown.js, chat.js, chat.css (nothing else; no build step, nothing from the internet)
    GET /favicon.ico        the same icon as a 32 x 32 PNG in an ICO file, drawn here (favicon_ico)

The page talks to the same server's /v1/models and /v1/chat/completions (streamed); with
--api_key it asks for the key and keeps it in the browser's localStorage.
"""

from __future__ import annotations

import struct
import zlib
from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}
PAGE_FILES = ("markdown.js", "chat.js", "chat.css")
ICON_SIZE = 32
ICON_BLUE = (0x2F, 0x5F, 0xD0)
# The page may load only its own files and talk only to this server.
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'"


def static_text(name: str) -> str:
    """The text of a file of core/serve/static."""
    return resources.files("bestiary.core.serve").joinpath("static").joinpath(name).read_text(encoding="utf-8")


def icon_shapes(x: float, y: float) -> tuple[bool, bool]:
    """(inside the square, inside the letter) at point (x, y) of index.html's 32 x 32 SVG icon.

    Square: corners rounded with radius 7, i.e. within 7 of the point clamped to [7, 25]^2.
    Letter "b": stem 9 <= x <= 13, 6 <= y <= 26; bowl 3.75 <= |(x, y) - (18, 19)| <= 7.25.
    """
    cx, cy = min(max(x, 7.0), 25.0), min(max(y, 7.0), 25.0)
    square = (x - cx) ** 2 + (y - cy) ** 2 <= 49.0
    bowl = 3.75 ** 2 <= (x - 18) ** 2 + (y - 19) ** 2 <= 7.25 ** 2
    return square, square and ((9 <= x <= 13 and 6 <= y <= 26) or bowl)


def icon_pixel(px: int, py: int, samples: int = 4) -> bytes:
    """RGBA of pixel (px, py): alpha a = the square's share of samples^2 points in the pixel, letter share w;
    colour = (w * white + (a - w) * blue) / a."""
    points = [icon_shapes(px + (i + 0.5) / samples, py + (j + 0.5) / samples)
              for i in range(samples) for j in range(samples)]
    a = sum(square for square, _ in points) / len(points)
    w = sum(letter for _, letter in points) / len(points)
    if a == 0:
        return bytes(4)
    rgb = [round((w * 255 + (a - w) * c) / a) for c in ICON_BLUE]
    return bytes([*rgb, round(a * 255)])


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """length (4 bytes, big-endian) + kind + data + CRC-32 of kind + data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@cache
def favicon_ico() -> bytes:
    """The icon as an ICO file holding one 32 x 32 RGBA PNG (ICONDIR, one ICONDIRENTRY, the PNG)."""
    n = ICON_SIZE
    rows = b"".join(b"\x00" + b"".join(icon_pixel(x, y) for x in range(n)) for y in range(n))  # filter 0 per row
    header = struct.pack(">IIBBBBB", n, n, 8, 6, 0, 0, 0)  # 8 bits per channel, colour type 6 (RGBA)
    png = (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(rows, 9))
           + png_chunk(b"IEND", b""))
    entry = struct.pack("<BBBBHHII", n, n, 0, 0, 1, 32, len(png), 6 + 16)  # 1 plane, 32 bpp, offset of the PNG
    return struct.pack("<HHH", 0, 1, 1) + entry + png


def web_router() -> APIRouter:
    """The chat page at /, its files under /static/ and its icon at /favicon.ico."""
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

    @router.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(favicon_ico(), media_type="image/x-icon", headers={"Cache-Control": "max-age=86400"})

    return router
