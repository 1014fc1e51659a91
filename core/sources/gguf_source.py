"""GGUF (llama.cpp) files as a weight source: HF tensor names, float32 tensors, HF-style config.

`open_gguf(path)` reads the file through `gguf.GGUFReader` (memory-mapped) and presents:

- weights under HF transformers names (`GGUFWeights`), renamed from llama.cpp's names by a table
  keyed by `general.architecture`; every quantization type `gguf.quants.dequantize` knows is
  decoded to float32 in HF orientation [out_features, in_features]; llama.cpp's Q/K row permutation
  is undone, so tensors equal the original HF checkpoint's (up to quantization);
- an HF-style config dict (`hf_config_from_gguf`);
- the tokenizer rebuilt from the metadata (`gguf_tokenizer.tokenizer_from_gguf`).

Supported architectures: llama. Add one by adding rows to TENSOR_NAMES, QK_PERMUTED and
CONFIG_BUILDERS.
"""

from __future__ import annotations

import math
import mmap
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor

from bestiary.core.format.errors import BestiaryError, ConfigError, WeightsError
from bestiary.core.sources.base import ModelSource, slice_dim
from bestiary.core.sources.gguf_reader import CompactGGUFReader
from bestiary.core.sources.gguf_tokenizer import tokenizer_from_gguf

# ---- tables --------------------------------------------------------------------------------------

# llama.cpp tensor name -> HF name, per architecture. "{n}" is the layer index.
TENSOR_NAMES: dict[str, dict[str, str]] = {
    "llama": {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
        "blk.{n}.attn_norm.weight": "model.layers.{n}.input_layernorm.weight",
        "blk.{n}.ffn_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
        **{
            f"blk.{{n}}.{gguf_name}.{kind}": f"model.layers.{{n}}.{hf_name}.{kind}"
            for gguf_name, hf_name in {
                "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj",
            }.items()
            for kind in ("weight", "bias")
        },
    },
}

# llama.cpp tensors that have no HF counterpart and are dropped on purpose, per architecture.
# rope_freqs holds Llama-3's per-frequency RoPE scale factors; hf_config_from_gguf turns it back
# into rope_scaling {"rope_type": "llama3", ...}, so the tensor itself is not needed.
DROPPED_TENSORS: dict[str, frozenset[str]] = {
    "llama": frozenset({"rope_freqs.weight"}),
}

# HF tensors whose rows llama.cpp's converter permuted, per architecture -> metadata key (under
# the architecture's prefix) giving the head count the permutation used.
QK_PERMUTED: dict[str, dict[str, str]] = {
    "llama": {
        "self_attn.q_proj.weight": "attention.head_count",
        "self_attn.q_proj.bias": "attention.head_count",
        "self_attn.k_proj.weight": "attention.head_count_kv",
        "self_attn.k_proj.bias": "attention.head_count_kv",
    },
}

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)$")


# ---- metadata helpers ----------------------------------------------------------------------------


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    """Value of metadata `key` (str / int / float / bool / list), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _require(reader: Any, key: str, path: Path | str) -> Any:
    """Value of metadata `key`; ConfigError naming the file and key when absent."""
    value = _meta(reader, key)
    if value is None:
        raise ConfigError(f"{path}: GGUF metadata key {key!r} is missing")
    return value


def _number(reader: Any, key: str, path: Path | str, default: Any = None, integer: bool = True,
            low: float = 1) -> Any:
    """Metadata `key` as an int (or a finite float) >= `low`; `default` when absent (None: required).
    A value of another type (a string, an array, a boolean) or range is a ConfigError naming the key."""
    value = _meta(reader, key, default)
    if value is None:
        raise ConfigError(f"{path}: GGUF metadata key {key!r} is missing")
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not integer:
        ok = ok or isinstance(value, float)
        ok = ok and math.isfinite(value) if ok and isinstance(value, float) else ok
    if not ok or value < low:
        kind = "an integer" if integer else "a finite number"
        shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:60]}..."
        raise ConfigError(f"{path}: GGUF metadata key {key!r}: expected {kind} >= {low:g} (got {shown})")
    return value


def _architecture(reader: Any, path: Path | str) -> str:
    """general.architecture, checked against the supported ones."""
    arch = _require(reader, "general.architecture", path)
    if not isinstance(arch, str) or arch not in TENSOR_NAMES:
        raise BestiaryError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(TENSOR_NAMES))})"
        )
    return arch


def _read_gguf(path: Path) -> Any:
    """A GGUFReader over `path`; BestiaryError (one line) for a missing, truncated or corrupt file."""
    if not path.is_file():
        raise BestiaryError(f"{path}: no such GGUF file")
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")  # numpy overflow warnings of corrupt offsets: checked below
            reader = CompactGGUFReader(path, "r")
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, struct errors, etc.
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise BestiaryError(f"{path}: not a readable GGUF file (truncated or corrupt?): {reason}") from None
    _check_tensor_extents(path, reader)
    return reader


def _check_tensor_extents(path: Path, reader: Any) -> None:
    """Every tensor's data must lie inside the file: the reader adds offsets in uint64, so a
    corrupt offset near 2**64 wrapped around to an earlier part of the file and read as weights."""
    size = path.stat().st_size
    for t in reader.tensors:
        relative = int(t.field.parts[-1][0])
        start = int(reader.data_offset) + relative
        if relative >= size or start + int(t.n_bytes) > size:
            raise BestiaryError(f"{path}: tensor {t.name!r} lies outside the file (offset {relative}, "
                                f"{int(t.n_bytes)} bytes, file {size} bytes): truncated or corrupt")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """HF name of llama.cpp tensor `gguf_name` for `arch`, or None if the table does not know it."""
    table = TENSOR_NAMES[arch]
    match = _LAYER.match(gguf_name)
    if match is None:
        return table.get(gguf_name)
    template = table.get(f"blk.{{n}}.{match.group(2)}")
    return None if template is None else template.format(n=match.group(1))


# ---- Q/K permutation -----------------------------------------------------------------------------


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` for q/k rows: interleaved rotary halves -> HF's split halves.

    llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape).
    w: [n_head * head_dim, ...] (weight [out, in] or bias [out]).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of even size")
    # [n_head, head_dim/2, 2, ...] -> [n_head, 2, head_dim/2, ...]
    out: np.ndarray = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return out


def _permute_heads(reader: Any, path: Path | str, arch: str) -> dict[str, int]:
    """HF key suffix (e.g. "self_attn.k_proj.weight") -> head count, for the q/k tensors to un-permute."""
    n_head = _number(reader, f"{arch}.attention.head_count", path)
    counts = {
        "attention.head_count": n_head,
        "attention.head_count_kv": _number(reader, f"{arch}.attention.head_count_kv", path, n_head),
    }
    return {suffix: counts[meta_key] for suffix, meta_key in QK_PERMUTED.get(arch, {}).items()}


# ---- weights -------------------------------------------------------------------------------------


DEQUANT_ROWS = 1024  # rows dequantized at a time: gguf.quants' temporaries stay a fraction of the output


def _dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """float32 values of raw GGUF tensor data (rows of bytes for quantized types, typed otherwise).

    Quantized rows are decoded DEQUANT_ROWS at a time into the output: gguf.quants makes several
    float32 temporaries of its input's size, so decoding a 49152-row embedding at once would hold
    about three copies of it (the largest transient of a GGUF convert)."""
    if data.dtype != np.uint8:  # F32/F16/F64/I8..I64: the reader already typed the array
        return data.astype(np.float32)  # a copy: never hand out views of the read-only mmap
    if data.ndim < 2 or data.shape[0] <= DEQUANT_ROWS:
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    first = np.asarray(gguf.quants.dequantize(data[:DEQUANT_ROWS], qtype), dtype=np.float32)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    out[:DEQUANT_ROWS] = first
    for start in range(DEQUANT_ROWS, data.shape[0], DEQUANT_ROWS):
        out[start:start + DEQUANT_ROWS] = gguf.quants.dequantize(data[start:start + DEQUANT_ROWS], qtype)
    return out


def _release_pages(data: np.ndarray) -> None:
    """Drop the file's pages from this process's resident set (they stay in the page cache): a
    convert reads every tensor once, and mapped pages it touched would otherwise count as its
    memory until the end (issue 27's convert-memory target)."""
    handle = getattr(data, "_mmap", None)
    if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
        handle.madvise(mmap.MADV_DONTNEED)


class GGUFWeights:
    """WeightSource over a GGUF file: HF keys, float32 tensors in HF orientation, read lazily."""

    def __init__(self, path: Path, reader: Any | None = None) -> None:
        """Index the tensors of `path` (reusing `reader` if given). Unknown tensor names are an error."""
        self.path = Path(path)
        self.reader = reader if reader is not None else _read_gguf(self.path)
        self.arch = _architecture(self.reader, self.path)
        self._tensors: dict[str, ReaderTensor] = {}  # HF key -> its tensor in the file
        for tensor in self.reader.tensors:
            if tensor.name in DROPPED_TENSORS.get(self.arch, ()):
                continue
            key = hf_name(tensor.name, self.arch)
            if key is None:
                raise WeightsError(
                    f"{self.path}: GGUF tensor {tensor.name!r} has no known HF name "
                    f"for architecture {self.arch!r}"
                )
            self._tensors[key] = tensor
        self._permute_heads = _permute_heads(self.reader, self.path, self.arch)  # HF suffix -> heads

    def keys(self) -> list[str]:
        """All tensor keys, HF names, in file order."""
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        """Full HF-orientation shape of `key` (GGUF dims reversed: [out, in])."""
        return tuple(int(d) for d in reversed(self._tensor(key).shape.tolist()))

    def file_of(self, key: str) -> str:
        """The GGUF file (all tensors live in one file)."""
        self._tensor(key)
        return str(self.path)

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        """Rank `tp_rank`'s float32 slice of `key` along `tp_dim` (whole tensor when tp_size == 1).

        Rows (tp_dim 0) are sliced before dequantizing, except for permuted q/k tensors, which are
        decoded whole, un-permuted, then sliced (un-permuting is only valid on whole heads).
        """
        tensor = self._tensor(key)
        shape = self.shape(key)
        index = slice_dim(shape, tp_size, tp_dim, tp_rank)
        n_head = self._heads_of(key)
        data = tensor.data  # numpy view [out, in] (quantized: [out, bytes_per_row])
        # numpy's overflow / invalid-value warnings on corrupt data: the non-finite check after the
        # load names the tensor and the count in one line (docs/safety.md), so they are not printed
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            values = self._decode(tensor, key, data, shape, index, n_head, tp_dim)
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        _release_pages(self.reader.data)
        return out

    def _decode(self, tensor: ReaderTensor, key: str, data: np.ndarray, shape: tuple[int, ...],
                index: tuple[slice, ...], n_head: int | None, tp_dim: int) -> np.ndarray:
        """float32 values of `key`'s slice `index` (un-permuted when `n_head` is set); one-line errors."""
        try:
            if n_head is not None:
                values = unpermute_qk(_dequantize(data, tensor.tensor_type), n_head)[index]
            elif tp_dim == 0 and len(shape) > 1:
                values = _dequantize(data[index[0]], tensor.tensor_type)  # only the rows we need
            else:
                values = _dequantize(data, tensor.tensor_type)[index]
        except NotImplementedError:
            raise WeightsError(
                f"{self.path}: tensor {tensor.name!r} ({key}) has type {tensor.tensor_type.name}, "
                "which cannot be dequantized"
            ) from None
        except ValueError as exc:  # un-permute: rows not divisible into heads
            raise WeightsError(f"{self.path}: tensor {tensor.name!r} ({key}): {exc}") from None
        return values

    def gguf_name(self, key: str) -> str:
        """llama.cpp name of HF key `key` (for messages)."""
        return self._tensor(key).name

    def _tensor(self, key: str) -> ReaderTensor:
        """ReaderTensor of `key`; WeightsError naming key and file when absent."""
        tensor = self._tensors.get(key)
        if tensor is None:
            raise WeightsError(f"{self.path}: no tensor {key!r} in this GGUF file")
        return tensor

    def _heads_of(self, key: str) -> int | None:
        """Head count to un-permute `key` with, or None when `key` is not a permuted q/k tensor."""
        match = _HF_LAYER.match(key)
        return None if match is None else self._permute_heads.get(match.group(1))


# ---- config --------------------------------------------------------------------------------------


def _llama3_rope_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, orig: int
) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama-3 RoPE scaling (convert_hf_to_gguf.py, LlamaModel). [head_dim/2]"""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = orig / low, orig / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _rope_scaling_from_freqs(reader: Any, path: Path | str, head_dim: int, theta: float) -> dict[str, Any] | None:
    """rope_scaling for a file with a rope_freqs tensor (Llama 3.1+), or None when it has none.

    The file keeps only the resulting factors; we check they are what Llama-3 scaling with the
    published low/high frequency factors (1, 4) and original context (8192) gives, with the
    largest factor as `factor`, and fail loudly otherwise rather than guess.
    """
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    with warnings.catch_warnings(), np.errstate(all="ignore"):  # corrupt values: refused below, in one line
        warnings.simplefilter("ignore", RuntimeWarning)
        found = _dequantize(tensor.data, tensor.tensor_type).reshape(-1)
    if not np.isfinite(found).all():
        raise ConfigError(f"{path}: tensor 'rope_freqs.weight' holds values that are not finite; the file is corrupt")
    if np.allclose(found, 1.0):
        return None
    factor, low, high, orig = float(found.max()), 1.0, 4.0, 8192
    params = {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
              "original_max_position_embeddings": orig}
    expected = _llama3_rope_factors(head_dim, theta, factor, low, high, orig)
    if found.shape != expected.shape or not np.allclose(found, expected, rtol=1e-4, atol=1e-4):
        raise ConfigError(
            f"{path}: tensor 'rope_freqs.weight' does not match Llama-3 RoPE scaling; not supported"
        )
    return {"rope_type": "llama3", **params}


def _rope_scaling(reader: Any, path: Path | str, arch: str) -> dict[str, Any] | None:
    """rope_scaling from {arch}.rope.scaling.* metadata (linear / yarn), or None."""
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(_number(reader, f"{arch}.rope.scaling.factor", path, integer=False, low=1e-30))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        orig = _number(reader, f"{arch}.rope.scaling.original_context_length", path)
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    raise ConfigError(f"{path}: {arch}.rope.scaling.type {kind!r} is not supported (linear, yarn)")


def _llama_config(reader: Any, path: Path | str) -> dict[str, Any]:
    """HF LlamaConfig dict from llama.* metadata and the tensor list."""

    def number(name: str, default: Any = None, integer: bool = True, low: float = 1) -> Any:
        return _number(reader, f"llama.{name}", path, default, integer, low)

    hidden = number("embedding_length")
    n_head = number("attention.head_count")
    n_kv = number("attention.head_count_kv", n_head)
    head_dim = number("attention.key_length", max(hidden // n_head, 1))
    rope_dim = _meta(reader, "llama.rope.dimension_count")
    if rope_dim is not None and number("rope.dimension_count") != head_dim:
        raise ConfigError(
            f"{path}: llama.rope.dimension_count {rope_dim} != head_dim {head_dim} (partial RoPE)"
        )
    theta = float(number("rope.freq_base", 10000.0, integer=False, low=1e-30))
    names = {t.name for t in reader.tensors}
    vocab = _meta(reader, "llama.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ConfigError(f"{path}: neither llama.vocab_size nor tokenizer.ggml.tokens is present")
    vocab = number("vocab_size", vocab)

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": number("feed_forward_length"),
        "num_hidden_layers": number("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(number("attention.layer_norm_rms_epsilon", integer=False, low=0)),
        "rope_theta": theta,
        "max_position_embeddings": number("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
    }
    pad = _meta(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    scaling = _rope_scaling(reader, path, "llama") or _rope_scaling_from_freqs(reader, path, head_dim, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


CONFIG_BUILDERS: dict[str, Callable[[Any, Path | str], dict[str, Any]]] = {
    "llama": _llama_config,
}


def hf_config_from_gguf(reader: Any, path: Path | str) -> dict[str, Any]:
    """HF-style config dict (LlamaConfig fields) from a GGUFReader's metadata; `path` is for messages."""
    return CONFIG_BUILDERS[_architecture(reader, path)](reader, path)


# ---- entry point ---------------------------------------------------------------------------------


def open_gguf(path: Path) -> ModelSource:
    """Open a .gguf file as a ModelSource (format "gguf"): weights, HF config, tokenizer if present."""
    path = Path(path)
    reader = _read_gguf(path)
    weights = GGUFWeights(path, reader)
    config = hf_config_from_gguf(reader, path)
    tokenizer = tokenizer_from_gguf(reader) if "tokenizer.ggml.model" in reader.fields else None
    return ModelSource(path=path, format="gguf", weights=weights, hf_config=config, tokenizer=tokenizer)
