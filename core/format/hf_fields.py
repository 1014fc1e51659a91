"""The JSON types and ranges of the HF config.json fields bestiary reads, checked where the file is read.

transformers' config classes would refuse most wrong values; bestiary reads config.json as a
plain dict, so a field of the wrong type reached arithmetic deep in a family's reader (`true`
taken as 1 for max_position_embeddings, `"rope_scaling": -1` iterated, `"architectures": true`
put in a set). `check_hf_fields(hf, source)` refuses, with one `ConfigError` line naming `source`
and the key, every field below that is present (not null) with another type or range:

  sizes, counts       integers (a boolean is not one) in 1..2**31, layer counts up to 1024
  sliding windows     integers >= 0 (0: no window); sliding_window_pattern 0..1024 or a string
  theta, eps, ratios  finite numbers (> 0; eps >= 0), partial rotary fractions in (0, 1]
  flags               booleans
  names               strings (model_type, hidden_act, dtype); architectures and layer_types:
                      lists of strings
  rope dicts          rope_scaling / rope_parameters: objects whose rope_type / type is a
                      string, factors finite and > 0, original_max_position_embeddings a size,
                      and llama3's low_freq_factor < high_freq_factor

Fields not listed are read by no family as numbers, or are checked by the config schema after.
"""

from __future__ import annotations

import math
from typing import Any

from bestiary.core.format.errors import ConfigError

MAX_SIZE = 2**31 - 1
MAX_LAYERS = 1024
LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
SIZE_NAMES = (
    "vocab_size", "padded_vocab_size", "hidden_size", "n_embd", "n_embed", "d_model", "dim",
    "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads", "n_head_kv",
    "multi_query_group_num", "head_dim", "kv_channels", "intermediate_size", "ffn_dim", "n_inner",
    "ffn_hidden_size", "ffn_hidden_dim", "inner_hidden_size", "moe_intermediate_size",
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
    "model_max_length", "num_experts", "num_local_experts", "num_experts_per_tok", "num_ln_in_parallel_attn",
    "shared_expert_intermediate_size", "word_embed_proj_dim",
)
WINDOW_NAMES = ("sliding_window", "max_window_layers")
POSITIVE_NUMBERS = ("rope_theta", "rotary_emb_base", "rope_ratio")
EPSILONS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "layernorm_epsilon", "norm_eps")
FRACTIONS = ("partial_rotary_factor", "rotary_pct")
FLAGS = (
    "tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias", "use_sliding_window", "multi_query_attention",
    "add_bias_linear", "add_qkv_bias", "use_dynamic_ntk", "use_logn_attn", "no_bias", "bias", "alibi",
    "parallel_attn", "new_decoder_architecture", "multi_query", "enable_bias", "_remove_final_layer_norm",
    "norm_head", "do_layer_norm_before", "use_parallel_residual", "norm_topk_prob", "position_encoding_2d",
    "rmsnorm", "post_layer_norm", "apply_residual_connection_post_layernorm", "layer_norm_elementwise_affine",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
)
NAMES = ("model_type", "hidden_act", "activation_function", "hidden_activation", "activation", "torch_dtype", "dtype")
NAME_LISTS = ("architectures", "layer_types")
OBJECTS = ("quantization_config",)
ROPE_DICTS = ("rope_scaling", "rope_parameters")
# Inside a rope dict: factors (finite, > 0), other numbers (finite), sizes, lists of factors.
ROPE_FACTORS = ("factor", "low_freq_factor", "high_freq_factor", "rope_theta")
ROPE_NUMBERS = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "extrapolation_factor")
ROPE_SIZES = ("original_max_position_embeddings",)
ROPE_LISTS = ("short_factor", "long_factor")


def shown(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters (a 1 MB string or a 10,000-item list in an error line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__} of {len(text)} characters)"


def is_int(value: Any) -> bool:
    """An integer, not a boolean (JSON `true` is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (not a boolean, not NaN or infinity, not an int too large for a float)."""
    if not (is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _fail(source: str, key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{source}: field {key!r}: expected {expected} (got {shown(value)})")


def _check_size(hf: dict[str, Any], key: str, source: str, low: int, high: int, within: str = "") -> None:
    """`hf[key]`, when set, is an integer in low..high (`within`: the dict's own key, for messages)."""
    value = hf.get(key)
    if value is not None and not (is_int(value) and low <= value <= high):
        raise _fail(source, within + key, value, f"an integer in {low}..{high}")


def _check_number(hf: dict[str, Any], key: str, source: str, low: float, low_open: bool, high: float,
                  within: str = "") -> None:
    """`hf[key]`, when set, is a finite number above `low` (or at it, unless `low_open`) and <= `high`."""
    value = hf.get(key)
    if value is None:
        return
    ok = is_number(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        expected = f"a finite number {bound}" + ("" if high == math.inf else f" and <= {high:g}")
        raise _fail(source, within + key, value, expected)


def check_hf_fields(hf: dict[str, Any], source: str) -> None:
    """ConfigError (one line: `source`, the key, what was expected, what was found) for the first
    field of the module docstring's table that `hf` sets to a wrong type or range."""
    for key in SIZE_NAMES:
        _check_size(hf, key, source, 1, MAX_SIZE)
    for key in LAYER_NAMES:
        _check_size(hf, key, source, 1, MAX_LAYERS)
    for key in WINDOW_NAMES:
        _check_size(hf, key, source, 0, MAX_SIZE)
    for key in POSITIVE_NUMBERS:
        _check_number(hf, key, source, 0.0, True, math.inf)
    for key in EPSILONS:
        _check_number(hf, key, source, 0.0, False, 1.0)
    for key in FRACTIONS:
        _check_number(hf, key, source, 0.0, True, 1.0)
    _check_types(hf, source)
    pattern = hf.get("sliding_window_pattern")
    if pattern is not None and not ((is_int(pattern) and 0 <= pattern <= MAX_LAYERS)  # 0: no window (Exaone4)
                                    or (isinstance(pattern, str) and 0 < len(pattern) <= MAX_LAYERS)):
        raise _fail(source, "sliding_window_pattern", pattern, f"an integer in 0..{MAX_LAYERS} or a pattern string")
    check_rope_fields(hf, source)


def _check_types(hf: dict[str, Any], source: str) -> None:
    """Flags are booleans, names strings, name lists lists of strings, objects objects."""
    for key in FLAGS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise _fail(source, key, hf[key], "true or false")
    for key in NAMES:
        if hf.get(key) is not None and not isinstance(hf[key], str):
            raise _fail(source, key, hf[key], "a string")
    for key in NAME_LISTS:
        value = hf.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise _fail(source, key, value, "a list of strings")
    for key in OBJECTS:
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise _fail(source, key, hf[key], "a JSON object")


def check_rope_fields(hf: dict[str, Any], source: str, complete: bool = True) -> None:
    """rope_scaling and rope_parameters: null or a JSON object of the types in the module docstring;
    `complete`: with every field its kind needs (linear: factor; llama3: its four)."""
    for key in ROPE_DICTS:
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise _fail(source, key, rope, "a JSON object or null")
        # transformers 5 may hold one rope dict per layer type (Gemma 3: full_attention, sliding_attention)
        inner = {f"{key}.{t}": rope[t] for t in ("full_attention", "sliding_attention") if t in rope}
        for name, part in (inner or {key: rope}).items():
            if not isinstance(part, dict):
                raise _fail(source, name, part, "a JSON object")
            _check_rope(part, name, source)
            if complete:
                _check_rope_kind(part, name, source)


def _check_rope(rope: dict[str, Any], key: str, source: str) -> None:
    """One rope dict (`key` names it in messages: rope_scaling.factor)."""
    for name in ("rope_type", "type"):
        if rope.get(name) is not None and not isinstance(rope[name], str):
            raise _fail(source, f"{key}.{name}", rope[name], "a string")
    within = f"{key}."
    for name in ROPE_FACTORS:
        _check_number(rope, name, source, 0.0, True, math.inf, within)
    for name in ROPE_NUMBERS:
        if rope.get(name) is not None and not is_number(rope[name]):
            raise _fail(source, f"{key}.{name}", rope[name], "a finite number")
    for name in ROPE_SIZES:
        _check_size(rope, name, source, 1, MAX_SIZE, within)
    for name in ROPE_LISTS:
        value = rope.get(name)
        if value is not None and not (isinstance(value, list) and all(is_number(v) and v > 0 for v in value)):
            raise _fail(source, f"{key}.{name}", value, "a list of finite numbers > 0")
    _check_number(rope, "partial_rotary_factor", source, 0.0, True, 1.0, within)


def _check_rope_kind(rope: dict[str, Any], key: str, source: str) -> None:
    """The fields the kinds core.layers.rotary computes need: linear a factor; llama3 its four, low < high."""
    kind = rope.get("rope_type", rope.get("type"))
    needed = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [n for n in needed.get(str(kind), ()) if rope.get(n) is None]
    if missing:
        raise ConfigError(f"{source}: field {key!r}: rope_type {kind!r} needs {', '.join(missing)}")
    if kind == "llama3" and not rope["low_freq_factor"] < rope["high_freq_factor"]:
        raise ConfigError(f"{source}: field {key!r}: llama3 needs low_freq_factor < high_freq_factor "
                          f"(got {rope['low_freq_factor']} and {rope['high_freq_factor']})")
