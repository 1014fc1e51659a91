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

import json
from typing import Annotated, Any, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from bestiary.core.runtime.guided import GuidedConfig
from bestiary.core.runtime.plugin_processors import ProcessorRequest
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
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for function and schema names
Schema = dict[str, Any]  # a JSON Schema (compiled, so checked, when the request is made: core.serve.completions)
# Types as OpenAI takes them (an integer field refuses "8", 8.0 and true; a boolean "yes"); Infinity and NaN
# in a float field are refused naming it; an unknown field is refused naming it.
STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the schema the output must validate against (always enforced, strict or not)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, populate_by_name=True)

    name: FunctionName
    description: Text | None = None
    schema_: Schema = Field(default_factory=dict, alias="schema")  # {} (OpenAI's default): any JSON value
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (free), json_object (one JSON object) or json_schema."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self

    def guided(self) -> GuidedConfig | None:
        """The constraint it asks for (None: free text)."""
        if self.type == "json_object":
            return GuidedConfig(json_object=True)
        if self.json_schema is not None:
            return GuidedConfig(json_schema=self.json_schema.schema_)
        return None


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


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
    # vLLM's field, bestiary's form: plugins' processors by name (docs/logits-processors.md)
    logits_processors: list[ProcessorRequest] | None = Field(None, max_length=16)
    user: Name | None = None  # accepted, changes nothing (as metadata, store, service_tier)
    metadata: dict[Name, Text] | None = None
    store: bool | None = None
    service_tier: Name | None = None
    # structured output (docs/serving.md#tools-and-response_format): OpenAI's response_format, or one of vLLM's
    response_format: ResponseFormat | None = None
    guided_json: Schema | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Annotated[Text, Field(min_length=1)]] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None
    guided_decoding_backend: Annotated[str, Field(min_length=1, max_length=100)] | None = None  # a plugin's

    @field_validator("guided_json")
    @classmethod
    def _json_text(cls, value: Schema | str | None) -> Schema | None:
        """guided_json as a schema object or its JSON text (vLLM takes both)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("expected a JSON Schema (an object, or its JSON text)") from None
            if not isinstance(value, dict):
                raise ValueError("expected a JSON Schema object")
        return value

    @field_validator(*GUIDED_FIELDS[1:])
    @classmethod
    def _one_constraint(cls, value: object, info: ValidationInfo) -> object:
        """At most one of response_format (other than text) and the guided_* fields."""
        given = [f for f in GUIDED_FIELDS[: GUIDED_FIELDS.index(str(info.field_name))] if info.data.get(f)
                 and not (f == "response_format" and info.data[f].type == "text")]
        if value is not None and given:
            raise ValueError(f"give one constraint: {given[0]} is given too")
        return value

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
            sink_token_length=self.sink_token_length, logits_processors=self.logits_processors or [],
            guided=self.guided(),
        )

    def guided(self) -> GuidedConfig | None:
        """The output constraint the request names (response_format or a guided_* field), None for none,
        compiled by `guided_decoding_backend` (a plugin's grammar backend) when given."""
        config = self._guided()
        if config is None or self.guided_decoding_backend is None:
            return config
        return config.model_copy(update={"backend": self.guided_decoding_backend})

    def _guided(self) -> GuidedConfig | None:
        if self.response_format is not None:
            return self.response_format.guided()
        if self.guided_json is not None:
            return GuidedConfig(json_schema=self.guided_json)
        if self.guided_regex is not None:
            return GuidedConfig(regex=self.guided_regex)
        if self.guided_choice is not None:
            return GuidedConfig(choice=self.guided_choice)
        if self.guided_grammar is not None:
            return GuidedConfig(grammar=self.guided_grammar)
        return None

    @property
    def guided_param(self) -> str:
        """The request field the constraint came from (what a 400 about it names)."""
        return next((f for f in GUIDED_FIELDS if getattr(self, f) is not None), "response_format")

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


class FunctionCall(BaseModel):
    """An assistant message's call: the function and its arguments as JSON text (as the model wrote them)."""

    model_config = STRICT

    name: FunctionName
    arguments: Text


class ToolCall(BaseModel):
    model_config = STRICT

    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_call(self) -> dict:
        """The call as chat templates take it (transformers'): arguments as an object when they are JSON."""
        try:
            arguments: object = json.loads(self.function.arguments)
        except ValueError:  # the model's own malformed text, sent back: rendered as it was
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # assistant: the calls it made
    tool_call_id: Name | None = None  # tool: the call this message answers
    refusal: Text | None = None  # an assistant message sent back as the openai client holds it; not rendered

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

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_answer(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") != "tool":
            raise ValueError("only a tool message has a tool_call_id")
        return value

    @model_validator(mode="after")
    def _tool_message(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @property
    def text(self) -> str:
        """The text content (text parts joined by newlines; "" for none)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def as_template_message(self) -> dict:
        """The dict a chat template sees: role and text content, name, tool_calls (arguments as objects, as
        transformers' templates expect), tool_call_id."""
        message: dict = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.as_template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionSpec(BaseModel):
    """A tool: its name, what it does, the JSON Schema of its arguments (an object)."""

    model_config = STRICT

    name: FunctionName
    description: Text | None = None
    parameters: Schema | None = None  # None: no arguments ({})
    strict: bool | None = None  # accepted; a call that tool_choice requires always follows the schema


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = STRICT

    name: FunctionName


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: call this one."""

    model_config = STRICT

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool] | None, info: ValidationInfo) -> list[Tool] | None:
        names = [t.function.name for t in value or []]
        repeated = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if repeated is not None:
            raise ValueError(f"function {repeated!r} is given twice")
        guided = next((f for f in GUIDED_FIELDS[1:] if info.data.get(f) is not None), None)
        if value and guided is not None:
            raise ValueError(f"cannot be combined with {guided} (response_format can)")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, value: str | NamedToolChoice | None, info: ValidationInfo) -> str | NamedToolChoice | None:
        names = [t.function.name for t in info.data.get("tools") or []]
        if value not in (None, "none") and not names:
            raise ValueError("tool_choice other than 'none' needs tools")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"function {value.function.name!r} is not among the tools ({', '.join(names)})")
        return value

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

    @property
    def tool_mode(self) -> str:
        """none (no tools, or tool_choice none), auto, required, or named (tool_choice names a function)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


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
