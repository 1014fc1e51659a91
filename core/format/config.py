"""The checkpoint config schema (config.json), as pydantic models.

Fields and defaults follow the TensorRT-LLM checkpoint table; architectures extend
`PretrainedConfig` by subclassing and adding their own fields. Unknown fields are an
error (a typo in config.json must not be silently ignored).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bestiary.core.format.errors import ConfigError
from bestiary.core.format.json_files import read_json as read_json  # re-exported: where callers import it

DType = Literal["float32", "float16", "bfloat16"]
PositionEmbedding = Literal[
    "learned_absolute", "rope_gpt_neox", "rope_gptj", "alibi", "alibi_with_scale", "relative", "chatglm"
]


class QuantAlgo(str, Enum):
    """Weight/activation quantization algorithms of the checkpoint spec."""

    W8A16 = "W8A16"
    W4A16 = "W4A16"
    W4A16_AWQ = "W4A16_AWQ"
    W4A8_AWQ = "W4A8_AWQ"
    W4A16_GPTQ = "W4A16_GPTQ"
    FP8 = "FP8"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"


class KVCacheQuantAlgo(str, Enum):
    """KV cache quantization algorithms of the checkpoint spec."""

    FP8 = "FP8"
    INT8 = "INT8"


class StrictModel(BaseModel):
    """Base for every config model: unknown fields are errors, enums serialize as values."""

    model_config = ConfigDict(extra="forbid", use_enum_values=True, validate_assignment=True)


MAX_RANKS = 65536  # a bound on every rank count: a config's 10**30 is refused, never looped over


class Mapping(StrictModel):
    """How the model is split over ranks: world_size = tp_size * pp_size.

    MoE experts (TensorRT-LLM's fields): the tp_size ranks of a stage hold the experts as
    moe_ep_size groups of E / moe_ep_size whole experts, each expert's FFN dim split over
    moe_tp_size ranks, tp_size = moe_tp_size * moe_ep_size. Defaults: moe_tp_size = tp_size,
    moe_ep_size = 1 (plain TP); giving one derives the other. Everything else stays TP over tp_size.
    Every size is a strict integer: 0.5, 2.0, "2", [2] or true in config.json is refused, never rounded.
    """

    world_size: int = Field(1, ge=1, le=MAX_RANKS, strict=True, description="Total number of ranks (tp_size * pp_size).")
    tp_size: int = Field(1, ge=1, le=MAX_RANKS, strict=True, description="Tensor-parallel ranks.")
    pp_size: int = Field(1, ge=1, le=MAX_RANKS, strict=True, description="Pipeline-parallel ranks.")
    moe_tp_size: int | None = Field(None, ge=1, le=MAX_RANKS, strict=True, description="Ranks each MoE expert's FFN dim is split "
                                    "over (default tp_size / moe_ep_size).")
    moe_ep_size: int | None = Field(None, ge=1, le=MAX_RANKS, strict=True, description="Ranks the MoE experts are spread over, "
                                    "E / moe_ep_size whole experts each (expert parallelism; default tp_size / "
                                    "moe_tp_size, else 1).")

    @model_validator(mode="after")
    def _check_world(self) -> Mapping:
        if self.world_size == 1 and self.tp_size * self.pp_size > 1:
            object.__setattr__(self, "world_size", self.tp_size * self.pp_size)
        if self.world_size != self.tp_size * self.pp_size:
            raise ValueError(
                f"world_size {self.world_size} != tp_size {self.tp_size} * pp_size {self.pp_size}"
            )
        moe_tp, moe_ep = moe_split(self.tp_size, self.moe_tp_size, self.moe_ep_size)
        object.__setattr__(self, "moe_tp_size", moe_tp)
        object.__setattr__(self, "moe_ep_size", moe_ep)
        return self

    def moe_tp_rank(self, rank: int) -> int:
        """Which part of each local expert's FFN dim global `rank` holds (TensorRT-LLM: tp_rank // moe_ep_size)."""
        return self.tp_rank(rank) // self.moe_sizes()[1]

    def moe_ep_rank(self, rank: int) -> int:
        """Which group of E / moe_ep_size experts global `rank` holds (TensorRT-LLM: tp_rank % moe_ep_size)."""
        return self.tp_rank(rank) % self.moe_sizes()[1]

    def moe_sizes(self) -> tuple[int, int]:
        """(moe_tp_size, moe_ep_size), both set by validation (the fields are None only before it)."""
        assert self.moe_tp_size is not None and self.moe_ep_size is not None, "set by _check_world"
        return self.moe_tp_size, self.moe_ep_size

    def tp_rank(self, rank: int) -> int:
        """Tensor-parallel rank of global `rank` (ranks are tp-major within a pipeline stage)."""
        return rank % self.tp_size

    def pp_rank(self, rank: int) -> int:
        """Pipeline stage of global `rank`."""
        return rank // self.tp_size


def moe_split(tp_size: int, moe_tp_size: int | None, moe_ep_size: int | None) -> tuple[int, int]:
    """(moe_tp_size, moe_ep_size) with moe_tp_size * moe_ep_size == tp_size: (tp_size, 1) when neither
    is given, the other derived when one is; ValueError (one line) when they do not multiply to tp_size."""
    if moe_tp_size is None and moe_ep_size is None:
        return tp_size, 1
    if moe_ep_size is None:
        assert moe_tp_size is not None  # not both None: returned above
        moe_ep_size = tp_size // moe_tp_size if tp_size % moe_tp_size == 0 else 0
    elif moe_tp_size is None:
        moe_tp_size = tp_size // moe_ep_size if tp_size % moe_ep_size == 0 else 0
    if moe_tp_size * moe_ep_size != tp_size:  # 0: the given one does not divide tp_size
        given = ", ".join(f"{n} {v}" for n, v in (("moe_tp_size", moe_tp_size), ("moe_ep_size", moe_ep_size)) if v)
        raise ValueError(f"{given}: moe_tp_size * moe_ep_size must equal tp_size {tp_size}")
    return moe_tp_size, moe_ep_size


class QuantConfig(StrictModel):
    """The `quantization` section of config.json."""

    quant_algo: QuantAlgo | None = Field(None, description="Weight quantization algorithm.")
    kv_cache_quant_algo: KVCacheQuantAlgo | None = Field(None, description="KV cache quantization.")
    group_size: int = Field(64, ge=1, description="Group size of group-wise weight quantization.")
    has_zero_point: bool = Field(False, description="Group-wise quantization stores zero points "
                                 "(W8A16: per-row zero points, imported from FastLLM .flm).")
    pre_quant_scale: bool = Field(False, description="AWQ-style per-input-channel pre-scale.")
    activation_quant: Literal["fastllm_uint8", "int8"] | None = Field(
        None, description="W8A16 / W4A16 only: quantize each Linear's input at run time as FastLLM's CPU "
                          "int8 / int4 matmuls do (fastllm_uint8: dynamic asymmetric uint8 per token row, or per "
                          "activation_group_size inputs); set when converting an int8 / int4 FastLLM .flm. "
                          "int8 (W8A16 / W4A16 only): W8A8 / W4A8 dynamic, symmetric int8 per token row and 64 "
                          "features, int32 dot products (--activation_precision int8).")
    activation_group_size: int | None = Field(None, ge=1, description="Inputs per activation_quant group "
                                              "(None: the whole row of one token).")
    exclude_modules: list[str] | None = Field(None, description="Module name patterns left unquantized.")


class PretrainedConfig(StrictModel):
    """config.json of a checkpoint: the TensorRT-LLM checkpoint table.

    Architectures subclass this and add their own fields (e.g. OPT's do_layer_norm_before).
    """

    architecture: str = Field(description="Registered architecture name, e.g. LlamaForCausalLM.")
    dtype: DType = Field(description="Dtype of the weights.")
    logits_dtype: DType = Field("float32", description="Dtype of the returned logits.")
    # Upper bounds: far above any real model, they stop a corrupt config from building a model
    # of 10**12 layers (minutes of Python, then out of memory) before the weights are compared.
    vocab_size: int = Field(ge=1, le=2**24)
    max_position_embeddings: int | None = Field(None, ge=1, le=2**24)
    hidden_size: int = Field(ge=1, le=2**17)
    num_hidden_layers: int = Field(ge=1, le=1024)
    num_attention_heads: int = Field(ge=1, le=2**12)
    num_key_value_heads: int | None = Field(None, ge=1, le=2**12, description="Defaults to num_attention_heads.")
    head_size: int | None = Field(None, ge=1, le=2**12, description="Defaults to hidden_size // num_attention_heads.")
    hidden_act: str
    intermediate_size: int | None = Field(None, ge=1, le=2**20)
    norm_epsilon: float = 1e-5
    position_embedding_type: PositionEmbedding = "learned_absolute"
    use_parallel_embedding: bool = False
    embedding_sharding_dim: int = 0
    mapping: Mapping = Field(default_factory=Mapping)
    quantization: QuantConfig = Field(default_factory=QuantConfig)

    @model_validator(mode="after")
    def _derive(self) -> PretrainedConfig:
        kv_heads = self.num_key_value_heads
        if kv_heads is None:
            kv_heads = self.num_attention_heads
            object.__setattr__(self, "num_key_value_heads", kv_heads)
        if self.head_size is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}; set head_size"
                )
            object.__setattr__(self, "head_size", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}"
            )
        return self

    def to_json_dict(self) -> dict[str, Any]:
        """Every field, defaults included (config.json writes them all)."""
        return self.model_dump(mode="json")


def format_validation_error(err: ValidationError, source: str, prefix: str = "") -> str:
    """One line: `source: field 'PREFIXa.b': message (got value)` for the first error (+ count of the
    others); the value is cut at 200 characters."""
    first = err.errors()[0]
    loc = prefix + ".".join(str(p) for p in first["loc"]) or "<root>"
    more = len(err.errors()) - 1
    tail = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
    value = f" (got {first['input']!r:.200})" if first["type"] not in ("missing",) and "input" in first else ""
    return f"{source}: field '{loc}': {first['msg']}{value}{tail}"


ModelT = TypeVar("ModelT", bound=BaseModel)


def validate_config(cls: type[ModelT], data: dict[str, Any], source: str, prefix: str = "") -> ModelT:
    """Validate `data` as `cls`; a bad field raises ConfigError naming the field (after `prefix`, the
    section's path in the file, e.g. 'pretrained_config.') and `source`."""
    if not isinstance(data, dict):
        section = prefix.rstrip(".") or "<root>"
        raise ConfigError(f"{source}: field '{section}': expected a JSON object, got {type(data).__name__} "
                          f"({data!r:.60})")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, prefix)) from None


ENGINE_SECTIONS = ("pretrained_config", "build_config")  # an engine's config.json; a checkpoint's is the model's


def config_sections(data: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(model config, build config) of a config.json read as `data`: an engine's pretrained_config and
    build_config ({} when absent), or a checkpoint's whole file and None. A section that is not a JSON
    object is a one-line ConfigError naming `source` and the field."""
    if "pretrained_config" not in data:
        return data, None
    model, build = data["pretrained_config"], data.get("build_config", {})
    for name, value in zip(ENGINE_SECTIONS, (model, build), strict=True):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: field '{name}': expected a JSON object, got {type(value).__name__} "
                              f"({value!r:.60})")
    return model, build


def config_mapping(data: dict[str, Any], source: str) -> Mapping:
    """The validated `mapping` of config.json `data` (engine or checkpoint; the default when absent):
    sizes are strict integers >= 1, errors name `source` and the field."""
    model, build = config_sections(data, source)
    prefix = "pretrained_config.mapping." if build is not None else "mapping."
    return validate_config(Mapping, model.get("mapping", {}), source, prefix)


def read_text_file(path: str | Path, flag: str) -> str:
    """A UTF-8 text file given by `flag`; a missing or non-UTF-8 file is a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: no such text file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{flag} {path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                          f"{err.start}); convert it to UTF-8") from None
