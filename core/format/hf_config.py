"""Reading the fields every HF decoder config.json shares, so a family's config is a few lines.

    read_common(hf, defaults)  sizes, heads, kv heads, head_dim, eps, act, max positions, tie
    read_rope(hf, theta)       rope theta, scaling (transformers 4's rope_theta / rope_scaling or
                               transformers 5's rope_parameters), partial rotary factor
    DecoderConfig              PretrainedConfig + rotary, biases, tie: the fields those fill
    WindowFields, MoEFields    DecoderConfig + a sliding window on some layers, + routed experts
    hf_config_reader(cls)      a spec's `from_hf_config` for a `DecoderConfig` subclass

A field is looked up under each of its HF names in turn (`COMMON_NAMES`: GPT-2's n_embd,
Falcon's n_head_kv, ...); an absent or null field takes the family's default (`defaults`,
keyed by bestiary field name), and a required one with neither is a `ConfigError` naming
every HF name tried.

Before anything reads them, `check_hf_fields(hf, source)` checks the HF fields the families
read by their JSON type and range (core.format.hf_fields): a size is an integer (`true` is not
1), a flag a boolean, `architectures` a list of strings, a rope dict a dict of finite positive
factors; a wrong one is a one-line `ConfigError` naming `source` (the config.json) and the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import Field, model_validator

from bestiary.core.format.config import Mapping, PositionEmbedding, PretrainedConfig, validate_config
from bestiary.core.format.errors import ConfigError
from bestiary.core.format.hf_fields import MAX_LAYERS, check_hf_fields, check_rope_fields, shown

# bestiary field -> the HF config.json names it is read from, first present wins.
COMMON_NAMES: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "n_embd", "n_embed", "d_model", "dim"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "head_size": ("head_dim", "kv_channels"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "ffn_hidden_dim"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                                "max_sequence_length"),
    "norm_epsilon": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "layernorm_epsilon", "norm_eps"),
    "hidden_act": ("hidden_act", "activation_function", "hidden_activation", "activation"),
    "tie_word_embeddings": ("tie_word_embeddings",),
}
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# Defaults of transformers' LlamaConfig, used where neither the source nor the family has a value.
LLAMA_DEFAULTS: dict[str, Any] = {"max_position_embeddings": 2048, "norm_epsilon": 1e-6, "hidden_act": "silu",
                                  "tie_word_embeddings": False, "rotary_base": 10000.0}


def first_present(hf: dict[str, Any], names: tuple[str, ...]) -> Any:
    """The value of the first of `names` that `hf` has and is not null, else None."""
    return next((hf[n] for n in names if hf.get(n) is not None), None)


def read_common(hf: dict[str, Any], defaults: dict[str, Any] | None = None,
                source: str = "config.json") -> dict[str, Any]:
    """The common `PretrainedConfig` fields of an HF config dict (+ tie_word_embeddings).

    intermediate_size defaults to 4 * hidden_size, num_key_value_heads to the query heads,
    head_size to hidden_size / heads; `defaults` (bestiary field names) fill the rest.
    """
    defaults = {**LLAMA_DEFAULTS, **(defaults or {})}
    out: dict[str, Any] = {}
    for field, names in COMMON_NAMES.items():
        value = first_present(hf, names)
        out[field] = defaults.get(field) if value is None else value
    missing = [f for f in REQUIRED if out[f] is None]
    if missing:
        tried = " / ".join(COMMON_NAMES[missing[0]])
        raise ConfigError(f"{source}: field '{tried}' is missing (needed for {missing[0]})")
    heads = out["num_attention_heads"]
    out["num_key_value_heads"] = out["num_key_value_heads"] or heads
    out["intermediate_size"] = out["intermediate_size"] or 4 * out["hidden_size"]
    if out["head_size"] is None and out["hidden_size"] % heads == 0:
        out["head_size"] = out["hidden_size"] // heads
    return out


def read_rope(hf: dict[str, Any], default_theta: float = 10000.0, default_pct: float = 1.0,
              source: str = "config.json", default_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """rotary_base, rotary_scaling (None for the default rope) and rotary_pct of an HF config.

    transformers 5 keeps theta, the scaling kind and partial_rotary_factor in `rope_parameters` (or
    one such dict per layer type: the "full_attention" one is read here, `layer_type_theta` reads another);
    earlier versions in `rope_theta`, `rope_scaling` ("type" or "rope_type") and
    `partial_rotary_factor` / `rotary_pct`. Either layout, or a mix, is read. A rope field of the
    wrong type or range is a ConfigError naming `source` (core.format.hf_fields.check_rope_fields;
    `hf_config_reader` also refuses a dict without the fields its kind needs). `default_scaling`: the
    family's scaling when the config names neither rope_scaling nor rope_parameters (gpt-oss: YaRN).
    """
    check_rope_fields(hf, source, complete=False)
    params = dict(hf.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):  # transformers 5, per layer type (Gemma 3): the global one
        params = dict(params["full_attention"])
    scaling = dict(hf.get("rope_scaling") or params)
    if default_scaling is not None and hf.get("rope_scaling") is None and hf.get("rope_parameters") is None:
        scaling = dict(default_scaling)
    theta = first_present(hf, ("rope_theta", "rotary_emb_base")) or params.get("rope_theta", default_theta)
    pct = first_present(hf, ("partial_rotary_factor", "rotary_pct")) or params.get("partial_rotary_factor",
                                                                                   default_pct)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    drop = ("rope_theta", "partial_rotary_factor")
    rope = None if kind == "default" else {k: v for k, v in scaling.items() if k not in drop}
    return {"rotary_base": float(theta), "rotary_scaling": rope, "rotary_pct": float(pct)}


def layer_type_theta(hf: dict[str, Any], layer_type: str, legacy: str, default: float) -> float:
    """RoPE theta of the layers of `layer_type` ("sliding_attention") when they have their own: transformers
    5's `rope_parameters[layer_type]["rope_theta"]`, else the earlier field `legacy` (Gemma 3's
    rope_local_base_freq), else `default`. Such layers take no scaling: another kind is a ValueError (a
    family's field reader: hf_config_reader makes it a ConfigError naming the config file)."""
    params = hf.get("rope_parameters") or {}
    own = params.get(layer_type) if isinstance(params, dict) else None
    if isinstance(own, dict):
        kind = own.get("rope_type", own.get("type", "default"))
        if kind != "default":
            raise ValueError(f"field 'rope_parameters.{layer_type}.rope_type' = {shown(kind)} is not supported "
                             "(expected 'default')")
        theta = own.get("rope_theta")
    else:
        theta = hf.get(legacy)
    return default if theta is None else float(theta)


class DecoderConfig(PretrainedConfig):
    """PretrainedConfig + the fields most decoder families add: rotary, biases, tied lm_head.

    Subclass it, narrow `architecture` with a Literal, and set the family's defaults.
    """

    hidden_act: str = Field("silu", description="MLP activation (silu, gelu, gelu_new, relu, ...).")
    position_embedding_type: PositionEmbedding = Field(
        "rope_gpt_neox", description="rope_gpt_neox / rope_gptj (rotary halves / pairs), alibi, learned_absolute, "
                                     "chatglm (2D rotary).")
    rotary_base: float = Field(10000.0, description="RoPE theta (HF rope_theta).")
    rotary_scaling: dict[str, Any] | None = Field(
        None, description="HF rope scaling: linear, llama3 or yarn (None: default).")
    rotary_pct: float = Field(1.0, gt=0.0, le=1.0, description="Fraction of each head's dims rotated.")
    qkv_bias: bool = Field(False, description="Bias on the fused qkv projection.")
    dense_bias: bool = Field(False, description="Bias on the attention output projection.")
    mlp_bias: bool = Field(False, description="Bias on the MLP's linears.")
    tie_word_embeddings: bool = Field(False, description="lm_head shares the input embedding.")

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head: head_size * rotary_pct (even)."""
        assert self.head_size is not None, "set by PretrainedConfig._derive"
        return int(self.head_size * self.rotary_pct) // 2 * 2


LayerType = Literal["sliding_attention", "full_attention"]


class WindowFields(DecoderConfig):
    """DecoderConfig + a sliding window on some layers (core.kernels.attention_window.layer_window):
    `sliding_window` W and, per layer, whether it attends through it (None: every layer does)."""

    sliding_window: int | None = Field(None, ge=1, description="Attention window W (None: no window layers).")
    layer_types: list[LayerType] | None = Field(
        None, description="Per layer: sliding_attention (through the window) or full_attention (every key).")

    @model_validator(mode="after")
    def _layer_count(self) -> WindowFields:
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        return self


class MoEFields(WindowFields):
    """WindowFields + a routed mixture of experts in every layer; intermediate_size is the FFN dim
    of one expert."""

    num_local_experts: int = Field(8, ge=1, description="Routed experts per MoE layer (E).")
    num_experts_per_tok: int = Field(2, ge=1, description="Experts each token is routed to (top-k).")

    @model_validator(mode="after")
    def _top_k(self) -> MoEFields:
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} > num_local_experts "
                             f"{self.num_local_experts}")
        return self


def window_layer_types(window: Callable[[dict[str, Any]], int | None],
                       windowed: Callable[[int, dict[str, Any]], bool]) -> Callable[[dict[str, Any]], list[str] | None]:
    """A reader of HF layer_types for WindowFields: None when `window(hf)` is None (every layer
    full), else the config's own `layer_types`, else "sliding_attention" on each layer i where
    `windowed(i, hf)` (the rule the family's HF config class derives them by)."""

    def read(hf: dict[str, Any]) -> list[str] | None:
        if window(hf) is None:
            return None
        if hf.get("layer_types"):
            return list(hf["layer_types"])
        n = first_present(hf, COMMON_NAMES["num_hidden_layers"])
        if not isinstance(n, int) or not 0 < n <= MAX_LAYERS:  # refused by check_hf_fields / read_common
            return None
        return ["sliding_attention" if windowed(i, hf) else "full_attention" for i in range(n)]

    return read


def refuse_unsupported(hf: dict[str, Any], supported: dict[str, Any], source: str) -> None:
    """ConfigError naming the first HF field set to something other than its one supported value
    (an absent or null field counts as supported)."""
    for name, value in supported.items():
        if hf.get(name) is not None and (hf[name] != value or type(hf[name]) is not type(value)):
            raise ConfigError(f"{source}: field {name!r} = {shown(hf[name])} is not supported (expected {value!r})")


def refuse_rope_kind(rope: dict[str, Any], kinds: tuple[str, ...], source: str) -> None:
    """ConfigError when read_rope's scaling is of a kind outside `kinds` (the default rope always passes)."""
    scaling = rope["rotary_scaling"]
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind is not None and kind not in kinds:
        supported = ", ".join(("default", *kinds))
        raise ConfigError(f"{source}: field 'rope_scaling': rope_type {kind!r} is not supported ({supported})")


def same_named(hf: dict[str, Any], cls: type[PretrainedConfig], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The HF fields (not null) named like a field `cls` adds to the common ones: a family's own field
    whose HF name is its name (`use_parallel_residual`, `norm_topk_prob`) is read without a lambda.
    The fields read under their HF names (COMMON_NAMES, rope, biases) and PretrainedConfig's own
    (dtype, mapping, ...) are never copied; `skip` names more."""
    own = set(cls.model_fields) - set(PretrainedConfig.model_fields) - set(DecoderConfig.model_fields) - set(skip)
    return {name: hf[name] for name in sorted(own) if hf.get(name) is not None}


ConfigT = TypeVar("ConfigT", bound=PretrainedConfig)
ROPE_KINDS = ("linear", "llama3", "yarn")  # the scalings core.layers.rotary computes (besides the default)


def derived(name: str, read: Callable[[dict[str, Any]], Any], hf: dict[str, Any], source: str) -> Any:
    """`read(hf)`: a family's reader of one field; what it cannot compute from the fields it was
    given (a null it divides, a zero it divides by) is a ConfigError naming `source` and the field."""
    try:
        return read(hf)
    except ConfigError:
        raise
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as err:
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(f"{source}: cannot derive field {name!r} from the config's fields "
                          f"({type(err).__name__}: {reason}); check the fields it is read from") from None


def hf_config_reader(
    cls: type[ConfigT], defaults: dict[str, Any] | None = None,
    unsupported: dict[str, Any] | None = None, rope_kinds: tuple[str, ...] | None = None,
    copy_same_named: bool | tuple[str, ...] = True, **fields: Any,
) -> Callable[..., ConfigT]:
    """A `from_hf_config(hf, dtype, mapping, source=...)` for `cls`.

    It checks the HF fields' types and ranges (`check_hf_fields`), refuses HF fields set otherwise
    than `unsupported` says (HF name -> the only value bestiary runs, e.g. {"use_sliding_window":
    False}), reads the common fields and the rope fields (those `cls` has; a rope scaling of a kind
    outside `rope_kinds`, by default ROPE_KINDS, the ones core.layers.rotary computes, is refused), HF
    `attention_bias` into qkv_bias and dense_bias and `mlp_bias` into mlp_bias (when the source sets
    them; else the class's defaults stand), copies every HF field
    named like one of the family's own fields (`same_named`; `copy_same_named=False` copies none, a
    tuple of names skips those), then applies `fields`: a value, or a callable `(hf) -> value`, per
    bestiary field (`qkv_bias=True`, `rotary_base=lambda hf: ...`). Validation errors are
    one-line `ConfigError`s naming `source`.
    """
    skip = copy_same_named if isinstance(copy_same_named, tuple) else ()
    theta = (defaults or {}).get("rotary_base", 10000.0)
    pct = (defaults or {}).get("rotary_pct", 1.0)

    def from_hf_config(hf: dict[str, Any], dtype: str, mapping: Mapping,
                       source: str = "config.json") -> ConfigT:
        check_hf_fields(hf, source)
        refuse_unsupported(hf, unsupported or {}, source)
        rope = read_rope(hf, theta, pct, source, (defaults or {}).get("rotary_scaling"))
        refuse_rope_kind(rope, ROPE_KINDS if rope_kinds is None else rope_kinds, source)
        data = read_common(hf, defaults, source) | rope
        if hf.get("attention_bias") is not None:  # absent: the class's own defaults (GPT-2's are all true)
            data |= {"qkv_bias": bool(hf["attention_bias"]), "dense_bias": bool(hf["attention_bias"])}
        if hf.get("mlp_bias") is not None:
            data["mlp_bias"] = bool(hf["mlp_bias"])
        if copy_same_named is not False:
            data |= same_named(hf, cls, skip)
        data |= {k: derived(k, v, hf, source) if callable(v) else v for k, v in fields.items()}
        data = {k: v for k, v in data.items() if k in cls.model_fields}
        return validate_config(cls, data | {"dtype": dtype, "mapping": mapping.model_dump()}, source)

    from_hf_config.__doc__ = f"{cls.__name__} from an HF config dict (bestiary.core.format.hf_config)."
    return from_hf_config
