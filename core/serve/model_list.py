"""GET /v1/models: the served model and its LoRA adapters (--lora_modules), as OpenAI's model list."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from bestiary.core.serve.settings import ServeSettings


def model_cards(settings: ServeSettings, max_model_len: int | None) -> list[dict[str, Any]]:
    """One card per served model name: the base model, then each adapter (parent: the base)."""
    base = settings.served_model_name
    cards: list[dict[str, Any]] = [{"id": base, "object": "model", "created": 0, "owned_by": "bestiary",
                                    "parent": None, "max_model_len": max_model_len}]
    cards += [{"id": name, "object": "model", "created": 0, "owned_by": "bestiary", "root": path, "parent": base,
               "max_model_len": max_model_len} for name, path in settings.lora_modules.items()]
    return cards


def models_router(settings: ServeSettings, max_model_len: int | None) -> APIRouter:
    """GET /v1/models."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards(settings, max_model_len)}

    return router
