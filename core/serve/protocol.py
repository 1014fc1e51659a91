"""OpenAI API request schemas and their translation to a SamplingConfig.

Field names, types, ranges and defaults follow OpenAI's API reference for
`/v1/completions` and `/v1/chat/completions`; `top_k`, `repetition_penalty`, `min_tokens`
and `ignore_eos` are vLLM's extensions, `max_attention_window` and `sink_token_length` bestiary's
(extra request fields, as vLLM's). Unknown fields are refused (400 naming the field),
so a typo never passes silently. Responses are plain dicts built in `generation`.
"""

from __future__ import annotations

from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bestiary.core.runtime.sampling import SamplingConfig


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both endpoints share: the model, sampling, stopping, outputs."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[int, float] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    max_attention_window: int | None = Field(None, ge=1)  # bestiary's (docs/attention-window.md)
    sink_token_length: int | None = Field(None, ge=0)
    user: str | None = None  # accepted, changes nothing (as metadata, store, service_tier)
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("expected up to 16 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        for token, bias in (value or {}).items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"token {token}: expected an id >= 0 and a bias in [-100, 100]")
        return value

    def sampling(self, max_new_tokens: int, top_log_probs: int | None) -> SamplingConfig:
        """The executor's config; top_log_probs None = no log probs, k >= 0 = log probs and k alternatives."""
        return SamplingConfig(
            max_new_tokens=max_new_tokens, min_length=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_strings=self.stop or [], temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            random_seed=self.seed, n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            embedding_bias=self.logit_bias or None, output_log_probs=top_log_probs is not None,
            top_log_probs=top_log_probs or 0, max_attention_window=self.max_attention_window,
            sink_token_length=self.sink_token_length,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    best_of: int | None = Field(None, ge=1)
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("expected a non-empty prompt")
        return value

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of {self.best_of} != n {self.n} is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as text or id lists (one request may carry several)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        ids = [t for t in p if isinstance(t, int)]
        if len(ids) == len(p):  # one prompt of token ids
            return [ids]
        return [t for t in p if not isinstance(t, int)]

    @property
    def token_limit(self) -> int:
        """max_tokens; null (which OpenAI allows) means the default, 16."""
        return 16 if self.max_tokens is None else self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, list):
            kinds = {part.get("type") for part in value}
            if kinds - {"text"}:
                raise ValueError(f"only text content parts are supported, not {sorted(map(str, kinds - {'text'}))}")
            return [TextPart.model_validate(part) for part in value]
        return value

    def as_template_message(self) -> dict:
        """The dict a chat template sees: role and text content (text parts joined by newlines)."""
        content: str | None
        if isinstance(self.content, list):  # TextParts: _text_only validated every part
            content = "\n".join(cast(TextPart, part).text for part in self.content)
        else:
            content = self.content
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        """max_completion_tokens (the current name), else max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_log_probs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
