"""The merged tensors of `.flm` files written by FastLLM's `model.save()`, split back into HF tensors.

FastLLM merges some linears while it loads an HF model (its `weightMergeRules`, e.g. LlamaModel /
Qwen2 / Qwen3 `InitParams` in src/models/*.cpp) and `model.save()` (basellm::SaveModel ->
WeightMap::SaveLowBitModel) writes the merged tensors as they are in memory:

    {p}.self_attn.mergeqkv.weight / .bias   = [q_proj; k_proj; v_proj]   (rows, in that order)
    {p}.gateup_proj.weight                   = [gate_proj; up_proj]       (rows, in that order;
                                               {p} is `...mlp`, `...mlp.experts.E`, `...mlp.shared_experts`)

The merge (src/model.cpp, `CreateLLMModelFromHF`, its `weightMergeRules` loop) allocates dims
[sum of the inputs' rows, K], memcpy's each input's data after the previous one and appends each
input's per-row (min, max) configs (int8 / int4, `perChannelAxis` 0) or per-row-and-group configs
(int4g) in the same order; heads are not interleaved, and GQA only makes the k and v blocks
shorter (num_key_value_heads * head_dim rows each). It merges only inputs of one data type and K
(and, for int4g, K a multiple of the group), so every part of a merged tensor is a row range of
it with the same type: `unmerge` presents each part as an FlmTensor of its own (offsets into the
same memory map, its own rows of configs), and everything downstream reads it as a torch2flm
tensor. The file carries no flag for this: the tensor names are the mark.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from bestiary.core.format.errors import ConfigError, WeightsError
from bestiary.core.format.hf_config import read_common
from bestiary.core.sources.flm_reader import FlmFile, FlmTensor

QKV = re.compile(r"^(?P<prefix>.+\.self_attn)\.mergeqkv\.(?P<part>weight|bias)$")
GATEUP = re.compile(r"^(?P<prefix>.+)\.gateup_proj\.(?P<part>weight|bias)$")


def is_merged(name: str) -> bool:
    return bool(QKV.match(name) or GATEUP.match(name))


def qkv_rows(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """(q, k, v) rows of a mergeqkv tensor from the HF config (core.format.hf_config.read_common's heads,
    kv heads and head size), None when the config lacks them."""
    try:
        common = read_common(config)
    except ConfigError:
        return None
    heads, kv, head_dim = common["num_attention_heads"], common["num_key_value_heads"], common["head_size"]
    if not all(isinstance(n, int) and n > 0 for n in (heads, kv, head_dim)):
        return None
    return heads * head_dim, kv * head_dim, kv * head_dim


def row_slice(t: FlmTensor, start: int, stop: int, name: str) -> FlmTensor:
    """Rows [start, stop) of `t` as a tensor of its own, named `name` (its data stays in the file's map)."""
    rows = t.dims[0]
    per_row = t.count // rows if rows else 0
    first_bit = start * per_row * t.ftype.bits
    if first_bit % 8:
        raise ValueError(f"row {start} starts inside a byte ({per_row} values of {t.ftype.bits} bits a row), "
                         f"so FastLLM's byte-wise merge did not keep {name!r} whole")
    bounds_offset = t.bounds_offset
    if t.ftype.quantized:
        if t.axis not in (0, -1):
            raise ValueError(f"quantization axis {t.axis}: only per-row (0) or per-tensor (-1) configs "
                             f"can be split by rows")
        if t.axis == 0:
            bounds_offset += 8 * start * t.groups
    return dataclasses.replace(t, name=name, dims=(stop - start, *t.dims[1:]), bounds_offset=bounds_offset,
                               data_offset=t.data_offset + first_bit // 8, part_of=t.name)


def split_rows(flm: FlmFile, t: FlmTensor, config: dict[str, Any]) -> list[FlmTensor]:
    """The HF tensors a merged tensor holds (module doc), or [t] when `t` is not a merged tensor."""
    sizes: tuple[int, ...] | None
    if match := QKV.match(t.name):
        sizes = qkv_rows(config)
        if sizes is None:
            raise WeightsError(f"{flm.path}: byte {t.offset}: tensor {t.name!r}: the model info has no "
                               f"num_attention_heads / head_dim to split q, k and v by")
        names = [f"{match['prefix']}.{p}_proj.{match['part']}" for p in "qkv"]
        what = (f"q, k, v of {sizes} rows ({config.get('num_attention_heads')} heads, "
                f"{config.get('num_key_value_heads') or config.get('num_attention_heads')} kv heads)")
    elif match := GATEUP.match(t.name):
        half = t.dims[0] // 2 if t.dims else 0
        sizes = (half, half)
        names = [f"{match['prefix']}.{p}_proj.{match['part']}" for p in ("gate", "up")]
        what = f"gate and up of {half} rows each"
    else:
        return [t]
    if not t.dims or t.dims[0] != sum(sizes):
        raise WeightsError(f"{flm.path}: byte {t.offset}: tensor {t.name!r}: dims {list(t.dims)} do not hold "
                           f"{what}")
    parts, start = [], 0
    try:
        for name, size in zip(names, sizes):
            parts.append(row_slice(t, start, start + size, name))
            start += size
    except ValueError as err:
        raise WeightsError(f"{flm.path}: byte {t.offset}: tensor {t.name!r}: {err}") from None
    return parts


def unmerge(flm: FlmFile, config: dict[str, Any]) -> FlmFile:
    """`flm` with every merged tensor replaced by the HF tensors it holds (in its place), or `flm` itself
    when it has none; a part whose name the file also holds is refused."""
    if not any(is_merged(name) for name in flm.tensors):
        return flm
    tensors: dict[str, FlmTensor] = {}
    for t in flm.tensors.values():
        for part in split_rows(flm, t, config):
            if part.name in tensors or (part.part_of and part.name in flm.tensors):
                raise WeightsError(f"{flm.path}: byte {t.offset}: tensor {t.name!r}: the file holds "
                                   f"{part.name!r} as well (merged and unmerged at once)")
            tensors[part.name] = part
    return dataclasses.replace(flm, tensors=tensors)
