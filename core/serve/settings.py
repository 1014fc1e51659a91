"""What `bestiary serve` was started with, besides the engine (the app and its routes read it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20  # a 128k-token prompt as text or ids is a few MB


class ServeSettings(BaseModel):
    """What `bestiary serve` was started with (besides the engine)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field(description="The model id clients name (GET /v1/models).")
    api_key: str | None = Field(None, description="Required as 'Authorization: Bearer KEY' on /v1/* when set.")
    max_queue_len: int = Field(1024, ge=1, description="Requests that may wait for a first token; more get 503.")
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=1,
                                   description="Largest request body taken; a larger one gets 413 before it is read.")
    request_timeout: float | None = Field(None, gt=0, allow_inf_nan=False,
                                          description="Seconds a request may take, from acceptance to its last "
                                                      "token; past it the request is cancelled (408, or an error "
                                                      "event in a stream). None: no limit.")
    pooling: Literal["last", "mean"] | None = Field(None, description="Embeddings' pooling (/v1/embeddings); None: "
                                                                       "the model's default.")
    lora_modules: dict[str, str] = Field(default_factory=dict,
                                         description="LoRA adapters served as model names: name -> HF PEFT dir.")
    tool_parser: Literal["auto", "hermes", "llama3", "mistral"] = Field(
        "auto", description="The format of tool calls in the model's text (core.serve.tool_calls); auto: the one "
                            "the chat template shows, hermes for a template without tools.")
