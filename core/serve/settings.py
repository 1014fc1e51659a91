"""What `bestiary serve` was started with, besides the engine (the app and its routes read it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServeSettings(BaseModel):
    """What `bestiary serve` was started with (besides the engine)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field(description="The model id clients name (GET /v1/models).")
    api_key: str | None = Field(None, description="Required as 'Authorization: Bearer KEY' on /v1/* when set.")
    max_queue_len: int = Field(1024, ge=1, description="Requests that may wait for a first token; more get 503.")
    lora_modules: dict[str, str] = Field(default_factory=dict,
                                         description="LoRA adapters served as model names: name -> HF PEFT dir.")
