"""MXFP4 tensors (OCP Microscaling Formats v1.0, MXFP4) read as float: gpt-oss's expert weights.

A source whose config.json says `quantization_config.quant_method: mxfp4` stores some matrices as two
tensors, `{name}_blocks` uint8 [..., N, G, 16] and `{name}_scales` uint8 [..., N, G]: each row of N
holds K = 32 G values in G blocks of 32, each block one shared scale and 32 FP4 (E2M1) elements, two
per byte, element 2i in the low nibble and 2i + 1 in the high one. Per the spec:

    E2M1 code b3 b2 b1 b0:  sign b3, exponent e = b2 b1 (bias 1), mantissa m = b0
        value = (-1)^sign * 2^(e - 1) * (1 + m / 2)      e > 0
              = (-1)^sign * (m / 2)                      e = 0 (subnormal: 0, 0.5)
        i.e. 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    E8M0 scale s:  X = 2^(s - 127);  s = 255 is NaN
    element = X * value

`dequantize` computes that exactly (every product is a float32 and a bfloat16 number). The wrapper
`Mxfp4Weights` lists each such pair as one tensor `{name}` [..., K, N], the layout transformers
dequantizes into (`convert_moe_packed_tensors`, which transposes the last two dims: gpt-oss's
`gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]), so a family's key map and hooks read a
quantized source exactly as a float one; a tensor-parallel slice is cut from the blocks before
dequantizing where it can (experts, out rows, whole groups of in features).
"""

from __future__ import annotations

import torch

from bestiary.core.format.errors import WeightsError
from bestiary.core.sources.base import WeightSource, slice_dim

BLOCK = 32  # elements per scale
PARTS = ("_blocks", "_scales")


def e2m1_values(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 E2M1 codes' values [16], from the spec's bit fields (not a copied table)."""
    codes = torch.arange(16)
    sign = torch.where(codes & 8 > 0, -1.0, 1.0)
    e, m = (codes >> 1) & 3, (codes & 1).double()
    magnitude = torch.where(e > 0, torch.exp2(e.double() - 1) * (1 + m / 2), m / 2)
    return (sign * magnitude).to(dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> values [..., 32 G] (spec order: low nibble first)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected "
                         f"[..., G, {BLOCK // 2}] and [..., G]")
    lut = e2m1_values(torch.float32)
    pairs = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    exponent = scales.to(torch.float32) - 127  # [..., G]
    values = torch.ldexp(pairs.flatten(-2), exponent[..., None])  # [..., G, 32]: X * value, exact in float32
    values = values.masked_fill((scales == 255)[..., None], float("nan"))  # E8M0 NaN
    return values.flatten(-2).to(dtype)  # [..., 32 G]; exact in bfloat16 too (<= 2 significant bits)


class Mxfp4Weights:
    """WeightSource over a source with MXFP4 pairs: each `{name}_blocks` / `{name}_scales` listed as
    `{name}` [..., K, N] dequantized (module doc); every other tensor passes through."""

    def __init__(self, inner: WeightSource, dtype: torch.dtype = torch.bfloat16) -> None:
        self.inner, self.dtype = inner, dtype
        raw = set(inner.keys())
        names = sorted(k[: -len("_blocks")] for k in raw if k.endswith("_blocks"))
        self._shapes: dict[str, tuple[int, ...]] = {name: self._checked(name, raw) for name in names}
        hidden = {f"{name}{part}" for name in names for part in PARTS}
        self._keys = [k for k in inner.keys() if k not in hidden] + names  # noqa: SIM118 - a WeightSource

    def _checked(self, name: str, raw: set[str]) -> tuple[int, ...]:
        """[..., K, N] of pair `name`; a missing scale or mismatched shapes is a WeightsError naming the file."""
        file = self.inner.file_of(f"{name}_blocks")
        if f"{name}_scales" not in raw:
            raise WeightsError(f"{file}: {name}_blocks has no {name}_scales (MXFP4 tensors come in pairs)")
        b, s = tuple(self.inner.shape(f"{name}_blocks")), tuple(self.inner.shape(f"{name}_scales"))
        if len(b) < 3 or b[-1] != BLOCK // 2 or b[:-1] != s:
            raise WeightsError(f"{file}: {name}_blocks {list(b)} / {name}_scales {list(s)}: expected "
                               f"[..., N, G, {BLOCK // 2}] / [..., N, G] (MXFP4)")
        return (*b[:-3], b[-2] * BLOCK, b[-3])

    # WeightSource
    def keys(self) -> list[str]:
        return list(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key] if key in self._shapes else self.inner.shape(key)

    def file_of(self, key: str) -> str:
        return self.inner.file_of(f"{key}_blocks" if key in self._shapes else key)

    def load(self, key: str, tp_size: int = 1, tp_dim: int = -1, tp_rank: int = 0) -> torch.Tensor:
        """Rank `tp_rank`'s slice of `key` along `tp_dim` (a pair: dequantized [..., K, N])."""
        if key not in self._shapes:
            return self.inner.load(key, tp_size, tp_dim, tp_rank)
        n = len(self._shapes[key])
        dim = tp_dim % n if tp_dim >= 0 else -1
        groups = self._shapes[key][-2] // BLOCK
        if dim == n - 1:  # N: the blocks' rows
            where = n - 2
        elif dim == n - 2 and groups % tp_size == 0:  # K: whole groups of 32
            where = n - 1
        elif 0 <= dim < n - 2:  # leading dims (experts)
            where = dim
        else:  # whole (then cut, for K not in whole groups per rank)
            where = -1
        parts = tp_size if where >= 0 else 1
        blocks = self.inner.load(f"{key}_blocks", parts, where, tp_rank)  # [..., N_r, G_r, 16]
        scales = self.inner.load(f"{key}_scales", parts, where, tp_rank)  # [..., N_r, G_r]
        try:
            full = dequantize(blocks, scales, self.dtype).transpose(-1, -2)  # [..., K_r, N_r]
        except ValueError as err:
            raise WeightsError(f"{self.file_of(key)}: {key}: {err}") from None
        if where == -1 and dim >= 0:
            full = full[slice_dim(tuple(full.shape), tp_size, dim, tp_rank)]
        return full.contiguous()
