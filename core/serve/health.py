"""The server's own routes, open without the API key: liveness and Prometheus metrics.

    GET /health      200 {"status": "ok"}
    GET /metrics     Prometheus text (core.serve.metrics)
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from bestiary.core.serve.metrics import ServerMetrics

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def health_router(metrics: ServerMetrics) -> APIRouter:
    """GET /health and GET /metrics (the scrape reads `metrics`)."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=PROMETHEUS_TEXT)

    return router
