"""OpenAI API request schemas and their translation to a SamplingConfig.

Field names, types, ranges and defaults follow OpenAI's API reference for
`/v1/completions` and `/v1/chat/completions`; `top_k`, `repetition_penalty`, `min_tokens`
and `ignore_eos` are vLLM's extensions, `max_attention_window` and `sink_token_length` bestiary's
(extra request fields, as vLLM's). Unknown fields are refused (400 naming the field),
so a typo never passes silently. Responses are plain dicts built in `generation`.

Every field is checked here, in one place, before anything runs: every number has a range (an
integer fits the 32- or 64-bit slot it goes to, a float is finite), every string is valid Unicode
(a lone surrogate such as "\ud800" cannot be tokenized) and bounded. What depends on the engine
(the context length, the vocabulary) is checked by core.serve.completions.
"""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from bestiary.core.runtime.sampling import MIN_TEMPERATURE, SamplingConfig

INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)  # torch's generator takes a 64-bit seed
MAX_STOP_CHARS = 4096
MAX_NAME_CHARS = 512


def _unicode(value: str) -> str:
    """Refuse a lone surrogate (JSON's "\ud800"): it is not text, and no tokenizer takes it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"invalid Unicode at character {err.start}: a lone surrogate "
                         f"{value[err.start]!r}") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
BiasKey = Annotated[int, Strict(False), Field(ge=0, le=INT32_MAX)]  # a JSON object's key is a string: "50256"
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]
# Types as OpenAI takes them (an integer field refuses "8", 8.0 and true; a boolean "yes"); Infinity and NaN
# in a float field are refused naming it; an unknown field is refused naming it.
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both endpoints share: the model, sampling, stopping, outputs."""

    model_config = STRICT

    model: Name
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Text | list[Annotated[Text, Field(max_length=MAX_STOP_CHARS)]] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    logit_bias: dict[BiasKey, float] | None = None
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    max_attention_window: Count | None = None  # bestiary's (docs/attention-window.md)
    sink_token_length: int | None = Field(None, ge=0, le=INT32_MAX)
    user: Name | None = None  # accepted, changes nothing (as metadata, store, service_tier)
    metadata: dict[Name, Text] | None = None
    store: bool | None = None
    service_tier: Name | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"expected 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"expected up to 16 non-empty strings of at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        for token, bias in (value or {}).items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"token {token}: expected a bias in [-100, 100], got {bias}")
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

    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX)  # 0: with echo, the prompt's log probs alone
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt's text (and log probs) before the completion's
    best_of: int | None = Field(None, ge=1, le=128)
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
    model_config = STRICT

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Name | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: object) -> object:
        """Content parts other than text (images, audio, files) are named before the parts are read."""
        if isinstance(value, list):
            kinds = [part.get("type") if isinstance(part, dict) else type(part).__name__ for part in value]
            other = next((k for k in kinds if k != "text"), None)
            if other is not None:
                raise ValueError(f"only text content parts are supported, not {str(other)[:64]!r}")
        return value

    def as_template_message(self) -> dict:
        """The dict a chat template sees: role and text content (text parts joined by newlines)."""
        content: str | None
        if isinstance(self.content, list):
            content = "\n".join(part.text for part in self.content)
        else:
            content = self.content
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
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


Inputs = Text | list[Text] | list[TokenId] | list[list[TokenId]]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's): one input or up to 2048."""

    model_config = STRICT

    model: Name
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: Name | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value):
        if isinstance(value, list) and (not value or len(value) > 2048 or any(
                isinstance(p, list | str) and not p for p in value)):
            raise ValueError("expected 1 to 2048 non-empty inputs")
        if isinstance(value, str) and not value:
            raise ValueError("expected a non-empty input")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs as texts or id lists (a list of ints is one input)."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(t, int) for t in v):
            return [cast(list[int], v)]
        return cast(list[str | list[int]], v)


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages through the chat template."""

    model_config = STRICT

    model: Name | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""

    model_config = STRICT

    model: Name | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)
