"""FastLLM `.flm` files as a model source (layout: core.sources.flm_format; index: flm_reader).

`open_flm(path)` presents:

- weights under their own names (torch2flm writes the HF state_dict names), read lazily from the
  memory map (`FlmWeights`): float32 / float16 / bfloat16 as stored, quantized tensors
  dequantized to float32 exactly as FastLLM computes them, w = (q - z) * s; the merged tensors of
  FastLLM's `model.save()` files (`mergeqkv`, `gateup_proj`) as the HF tensors they hold
  (core.sources.flm_merged: row ranges of the same data);
- an HF-style config dict: the model info (every value was str()-ed) parsed back to numbers,
  booleans, lists and dicts (`rope_scaling.type` -> rope_scaling {"type": ...}); when the linears
  are quantized, a `quantization_config` {"quant_method": "fastllm", "bits", "group_size"} that
  makes `bestiary convert` import the codes as they are (core.convert.import_prequantized) through
  `FlmWeights.prequantized`:
      int8 (per row, any zero point)         -> W8A16 with zero points: weight int8 = q - 128,
                                                 zeros = z - 128, weights_scaling_factor = s
      int4 per row (codes 4, 8)              -> W4A16 with zero points, the row's (s, z) repeated
                                                 over every group (exact)
      int4 grouped by a multiple of 32 (9)   -> W4A16 with zero points, each group's (s, z)
                                                 repeated over its sub-groups (exact)
  a linear that cannot land exactly (another int type than the file's majority, a group size
  that is not a multiple of 32, an odd number of in-features) is re-quantized from its FastLLM
  values and the error this adds is printed;
- the tokenizer rebuilt from the vocab section (core.sources.vocab_tokenizer), with FastLLM's
  chat keys as the chat template.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bestiary.core.format.errors import WeightsError
from bestiary.core.format.hf_fields import check_hf_fields
from bestiary.core.sources.base import ModelSource, slice_dim
from bestiary.core.sources.flm_format import NUMPY_FLOAT, low_bit_grid, unpack_nibbles
from bestiary.core.sources.flm_merged import unmerge
from bestiary.core.sources.flm_reader import FlmFile, FlmTensor, read_flm

GROUPS = (128, 64, 32)  # W4A16 group sizes, largest first
CANONICAL_PARTS = ("weight", "weights_scaling_factor", "zeros")


# ---- decoding ------------------------------------------------------------------------------------


def _floats(flm: FlmFile, t: FlmTensor, count: int, offset: int) -> np.ndarray:
    return np.frombuffer(flm.data, dtype="<f4", count=count, offset=offset)


def grid_of(flm: FlmFile, t: FlmTensor) -> tuple[np.ndarray, np.ndarray]:
    """(s, z) float32 [configs] of a quantized tensor, as FastLLM's LowBitConfig makes them."""
    pairs = _floats(flm, t, 2 * t.configs, t.bounds_offset).reshape(-1, 2)
    return low_bit_grid(pairs[:, 0], pairs[:, 1], t.ftype.bits)


def codes_of(flm: FlmFile, t: FlmTensor) -> np.ndarray:
    """The integer codes, uint8, in the tensor's dims."""
    raw = np.frombuffer(flm.data, dtype=np.uint8, count=(t.count * t.ftype.bits + 7) // 8, offset=t.data_offset)
    codes = raw if t.ftype.bits == 8 else unpack_nibbles(raw, t.count)
    return codes.reshape(t.dims)


def _rows(t: FlmTensor) -> tuple[int, int]:
    """(rows, values per row) of a quantized tensor seen as [dims[0], rest] (axis 0) or [1, all]."""
    if t.axis == -1:
        return 1, t.count
    if t.axis != 0:
        raise ValueError(f"quantization axis {t.axis} (only 0 or -1 are supported)")
    return t.dims[0], t.count // max(t.dims[0], 1)


def dequantize(flm: FlmFile, t: FlmTensor) -> torch.Tensor:
    """float32 tensor of FastLLM's values (q - z) * s of a quantized tensor."""
    s, z = grid_of(flm, t)
    rows, k = _rows(t)
    q = codes_of(flm, t).reshape(rows, k).astype(np.float32)
    if t.ftype.grouped:
        g = t.group_size
        s = np.repeat(s.reshape(rows, t.groups), g, axis=1)[:, :k]
        z = np.repeat(z.reshape(rows, t.groups), g, axis=1)[:, :k]
        w = (q - z) * s
    else:
        w = (q - z[:, None]) * s[:, None]
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(t.dims))


def read_tensor(flm: FlmFile, t: FlmTensor) -> torch.Tensor:
    """A tensor's values: float types as stored (a copy), quantized ones dequantized to float32."""
    try:
        if t.ftype.quantized:
            return dequantize(flm, t)
        if t.ftype.code == 1:  # bfloat16
            raw = np.frombuffer(flm.data, dtype="<u2", count=t.count, offset=t.data_offset)
            return torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16).reshape(t.dims).clone()
        values = np.frombuffer(flm.data, dtype=NUMPY_FLOAT[t.ftype.code], count=t.count, offset=t.data_offset)
        return torch.from_numpy(values.copy()).reshape(t.dims)
    except ValueError as err:
        raise WeightsError(f"{flm.path}: byte {t.offset}: tensor {t.label}: {err}") from None


# ---- quantized layout ----------------------------------------------------------------------------


def linear_quant_kind(t: FlmTensor) -> str | None:
    """"int8" / "int4" for a quantized 2-D `.weight` a Linear can hold, else None."""
    if not (t.ftype.quantized and len(t.dims) == 2 and t.name.endswith(".weight")):
        return None
    return "int8" if t.ftype.bits == 8 else "int4"


def activation_group(tensors: list[FlmTensor]) -> int | None:
    """The input group FastLLM's int4 matmuls quantize activations by: the weight group of grouped
    int4 (the smallest when several), None (per token row) for int8 and per-row int4."""
    sizes = {t.group_size for t in tensors if t.ftype.grouped and t.groups > 1}
    return min(sizes) if sizes else None


def common_group(tensors: list[FlmTensor]) -> int:
    """The W4A16 group size every grouped int4 tensor lands in exactly (128 when none is grouped)."""
    sizes = {t.group_size for t in tensors if t.ftype.grouped and t.groups > 1}  # one group a row fits any G
    for g in GROUPS:
        if all(size % g == 0 for size in sizes):
            return g
    return GROUPS[-1]


def exact_int4(t: FlmTensor, group: int) -> bool:
    """True when `t` lands in W4A16 with groups of `group` without re-quantizing."""
    return t.dims[1] % 2 == 0 and t.axis == 0 and (not t.ftype.grouped or t.groups == 1 or t.group_size % group == 0)


def canonical_int8(flm: FlmFile, t: FlmTensor) -> dict[str, torch.Tensor]:
    """W8A16 + zero points: weight int8 [N, K] = q - 128, weights_scaling_factor [N], zeros [N] = z - 128."""
    s, z = grid_of(flm, t)
    q = codes_of(flm, t).astype(np.int16) - 128
    return {"weight": torch.from_numpy(q.astype(np.int8)),
            "weights_scaling_factor": torch.from_numpy(s.copy()),
            "zeros": torch.from_numpy(z - np.float32(128))}


def canonical_int4(flm: FlmFile, t: FlmTensor, group: int) -> dict[str, torch.Tensor]:
    """W4A16 + zero points, groups of `group`: each FastLLM (s, z) repeated over the groups it covers."""
    from bestiary.core.format.packing import num_groups, pack_int4

    n, k = t.dims
    s, z = grid_of(flm, t)
    per = t.group_size // group if t.ftype.grouped and t.groups > 1 else num_groups(k, group)
    groups = num_groups(k, group)
    s = np.repeat(s.reshape(n, -1), per, axis=1)[:, :groups]
    z = np.repeat(z.reshape(n, -1), per, axis=1)[:, :groups]
    codes = torch.from_numpy(codes_of(flm, t).copy())
    return {"weight": pack_int4(codes), "weights_scaling_factor": torch.from_numpy(np.ascontiguousarray(s)),
            "zeros": torch.from_numpy(np.ascontiguousarray(z))}


def requantize(flm: FlmFile, t: FlmTensor, bits: int, group: int) -> dict[str, torch.Tensor]:
    """Re-quantize FastLLM's values of `t` into the file's bestiary layout; prints the error it adds."""
    from bestiary.core.format import packing

    w = dequantize(flm, t)
    if bits == 8:
        q, s = packing.quantize_int8_per_channel(w)
        out = {"weight": q, "weights_scaling_factor": s, "zeros": torch.zeros_like(s)}
        back = packing.dequantize_int8(q, s)
    else:
        codes, s, z = packing.quantize_int4_groupwise(w, group, zero_point=True)
        assert z is not None  # zero_point=True: the zero points are always returned
        out = {"weight": packing.pack_int4(codes), "weights_scaling_factor": s, "zeros": z}
        back = packing.dequantize_int4(codes, s, z, group)
    err = (back - w).abs()
    rel = float(err.norm() / w.norm().clamp(min=1e-12))
    print(f"{flm.path}: {t.name} ({t.ftype.name}, dims {list(t.dims)}) re-quantized to "
          f"{'int8' if bits == 8 else f'int4 g{group}'}: max |error| {float(err.max()):.3g}, "
          f"relative {rel:.3%}", file=sys.stderr)
    return out


# ---- the weight source ---------------------------------------------------------------------------


class FlmWeights:
    """WeightSource over a .flm file: its own tensor names, float values, read lazily."""

    def __init__(self, flm: FlmFile) -> None:
        self.flm = flm
        self.path = flm.path

    def keys(self) -> list[str]:
        return list(self.flm.tensors)

    def tensor(self, key: str) -> FlmTensor:
        t = self.flm.tensors.get(key)
        if t is None:
            raise WeightsError(f"{self.path}: no tensor {key!r} in this .flm file")
        return t

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensor(key).dims

    def file_of(self, key: str) -> str:
        return str(self.path)

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        full = read_tensor(self.flm, self.tensor(key))
        return full[slice_dim(tuple(full.shape), tp_size, tp_dim, tp_rank)].contiguous()

    def quant_layout(self) -> dict[str, Any] | None:
        """{"bits", "group_size"} of the file's quantized linears (None when they are all float)."""
        linears = [t for t in self.flm.tensors.values() if linear_quant_kind(t)]
        if not linears:
            return None
        int8 = sum(linear_quant_kind(t) == "int8" for t in linears)
        bits = 8 if int8 * 2 >= len(linears) else 4
        int4 = [t for t in linears if t.ftype.bits == 4]
        return {"bits": bits, "group_size": common_group(int4), "activation_group": activation_group(int4)}

    def prequantized(self, bits: int, group: int) -> FlmQuantWeights:
        return FlmQuantWeights(self, bits, group)


class FlmQuantWeights:
    """WeightSource presenting the quantized linears of a .flm file in bestiary's packed layout:
    `{layer}.weight`, `.weights_scaling_factor`, `.zeros` (module doc); other tensors as FlmWeights."""

    def __init__(self, inner: FlmWeights, bits: int, group: int) -> None:
        self.inner, self.bits, self.group = inner, bits, group
        self.quantized_layers: set[str] = set()
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._owner: dict[str, FlmTensor] = {}
        keys = []
        for name, t in inner.flm.tensors.items():
            if linear_quant_kind(t) is None:
                keys.append(name)
                continue
            layer = name.removesuffix(".weight")
            self.quantized_layers.add(layer)
            n, k = t.dims
            groups = -(-k // group)
            shapes = ({"weight": (n, k), "weights_scaling_factor": (n,), "zeros": (n,)} if bits == 8 else
                      {"weight": (n, k // 2 + k % 2), "weights_scaling_factor": (n, groups), "zeros": (n, groups)})
            for part, shape in shapes.items():
                self._shapes[f"{layer}.{part}"] = shape
                self._owner[f"{layer}.{part}"] = t
                keys.append(f"{layer}.{part}")
        self._keys = keys
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def keys(self) -> list[str]:
        return list(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key] if key in self._shapes else self.inner.shape(key)

    def file_of(self, key: str) -> str:
        return str(self.inner.path)

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        t = self._owner.get(key)
        if t is None:
            return self.inner.load(key, tp_size, tp_dim, tp_rank)
        full = self.canonical(t)[key.rpartition(".")[2]]
        return full[slice_dim(tuple(full.shape), tp_size, tp_dim, tp_rank)].contiguous()

    def canonical(self, t: FlmTensor) -> dict[str, torch.Tensor]:
        """{weight, weights_scaling_factor, zeros} of `t` in the file's layout (the last one is cached)."""
        if self._cached is not None and self._cached[0] == t.name:
            return self._cached[1]
        flm = self.inner.flm
        try:
            if self.bits == 8 and t.ftype.bits == 8 and t.axis == 0:
                out = canonical_int8(flm, t)
            elif self.bits == 4 and t.ftype.bits == 4 and exact_int4(t, self.group):
                out = canonical_int4(flm, t, self.group)
            else:
                out = requantize(flm, t, self.bits, self.group)
        except ValueError as err:
            raise WeightsError(f"{flm.path}: byte {t.offset}: tensor {t.label}: {err}") from None
        self._cached = (t.name, out)
        return out


# ---- config --------------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """A model-info value back from its text: Python's str() (torch2flm) or JSON (FastLLM's C++ writes
    the config.json values it read, `false`, `[\\n\\t"LlamaForCausalLM"\\n]`, for model.save()):
    int, float, bool, None, list, dict, else the string."""
    try:  # TypeError: an unhashable dict key or set member ('{[1]: 2}')
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def hf_config_from_info(info: dict[str, str]) -> dict[str, Any]:
    """The HF-style config: values parsed, dotted keys (rope_scaling.type) nested back into dicts.

    FastLLM's chat keys and tokenizer flags stay strings (their text is the value)."""
    config: dict[str, Any] = {}
    for key, text in info.items():
        value = text if key in ("pre_prompt", "user_role", "bot_role", "history_sep", "chat_template") else parse_value(text)
        head, dot, rest = key.partition(".")
        if dot and head in ("rope_scaling",):
            if not isinstance(config.setdefault(head, {}), dict):  # 'rope_scaling' and 'rope_scaling.type' both
                config[head] = {}  # the dotted keys are FastLLM's own layout: they win
            config[head][rest] = value
        else:
            config[key] = value
    return config


# ---- entry point ---------------------------------------------------------------------------------


def open_flm(path: Path) -> ModelSource:
    """Open a .flm file as a ModelSource (format "flm")."""
    from bestiary.core.sources.vocab_tokenizer import tokenizer_from_flm

    flm = read_flm(path)
    config = hf_config_from_info(flm.info)
    if "model_type" not in config:
        raise WeightsError(f"{path}: the model info has no 'model_type'")
    check_hf_fields(config, f"{path} (model info)")  # the values' types and ranges, before anything reads them
    flm = unmerge(flm, config)  # model.save()'s mergeqkv / gateup_proj -> the HF tensors
    weights = FlmWeights(flm)
    layout = weights.quant_layout()
    if layout is not None:  # FastLLM's own files (no bestiary key) run with FastLLM's input quantization
        act = flm.info.get("bestiary.activation_quant", "fastllm_uint8")
        layout["activation_quant"] = None if act == "none" else act
        config["quantization_config"] = {"quant_method": "fastllm", **layout}
    config.setdefault("torch_dtype", _float_dtype(flm))
    return ModelSource(path=Path(path), format="flm", weights=weights, hf_config=config,
                       tokenizer=tokenizer_from_flm(flm, config))


def _float_dtype(flm: FlmFile) -> str:
    """float16 when the float linears are float16, else float32 (a .flm has no torch_dtype of its own)."""
    codes = {t.ftype.code for t in flm.tensors.values() if len(t.dims) == 2}
    return "float16" if 7 in codes else "float32"
