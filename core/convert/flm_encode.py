"""One tensor in .flm bytes (layout: core.sources.flm_format), from a bundle of core.convert.flm_tables.

Quantized .flm types keep bestiary's codes where the grid is the same (exact):
    W8A16 (q int8, s, z)        -> int8:   u = q + 128, zero point z + 128, (min, max) = grid_bounds
    W4A16 (codes, s, z per G)   -> int4gG: codes as they are, (min, max) per group = grid_bounds
    W4A16 whose groups share (s, z) per row -> int4 (per row)
and otherwise quantize the (dequantized) float weight with FastLLM's own rule (LowBitConfig over the
row's / group's (min, max); q = trunc(w / s + z + 0.5) clamped), printing the error this adds.
"""

from __future__ import annotations

import math
import re
import sys

import numpy as np
import torch

from bestiary.core.format import packing
from bestiary.core.sources.flm_format import (
    CODES,
    grid_bounds,
    low_bit_grid,
    pack_int,
    pack_nibbles,
    pack_string,
)

_GROUPED = re.compile(r"^int4g(\d+)$")


def parse_group(dtype: str) -> int | None:
    """G of "int4gG" (None for other names)."""
    match = _GROUPED.match(dtype)
    return int(match.group(1)) if match and int(match.group(1)) > 0 else None


def plain_dtype(dtype: str) -> str:
    """The type of a tensor that is not a Linear weight: float32, as FastLLM's exporter writes it."""
    return "float32"


# ---- bestiary layouts ----------------------------------------------------------------------------


def _bits(bundle) -> int:
    return 8 if bundle["weight"].dtype == torch.int8 else 4


def _k(bundle) -> int:
    w = bundle["weight"]
    return w.shape[1] if _bits(bundle) == 8 else 2 * w.shape[1]


def _group(bundle) -> int:
    groups = bundle["weights_scaling_factor"].shape[1]
    k = _k(bundle)
    return next(g for g in (32, 64, 128, k) if -(-k // g) == groups)


def float_of(bundle) -> torch.Tensor:
    """The float32 tensor of a bundle (a quantized linear dequantized: (q - z) * s)."""
    if "value" in bundle:
        return bundle["value"].float()
    s, z = bundle["weights_scaling_factor"], bundle.get("zeros")
    if _bits(bundle) == 8:
        return packing.dequantize_int8(bundle["weight"], s, z)
    return packing.dequantize_int4(packing.unpack_int4(bundle["weight"]), s, z, _group(bundle))


def _integral(z: np.ndarray, top: int) -> bool:
    return bool(np.all(z == np.round(z)) and np.all((z >= 0) & (z <= top)))


def exact_int8(bundle):
    """(codes uint8 [N, K], s [N], z [N]) in FastLLM's int8 terms, or None when not exact."""
    if "weight" not in bundle or _bits(bundle) != 8:
        return None
    s = bundle["weights_scaling_factor"].float().numpy()
    z = (bundle["zeros"].float().numpy() if "zeros" in bundle else np.zeros_like(s)) + np.float32(128)
    if not _integral(z, 255) or not _same_grid(s, z, 8):
        return None
    codes = (bundle["weight"].numpy().astype(np.int16) + 128).astype(np.uint8)
    return codes, s, z


def exact_int4(bundle, group: int | None):
    """(codes uint8 [N, K], s [N, g], z [N, g]) for groups of `group` (None: one per row), or None."""
    if "weight" not in bundle or _bits(bundle) != 4:
        return None
    s = bundle["weights_scaling_factor"].float().numpy()
    z = bundle["zeros"].float().numpy() if "zeros" in bundle else np.full_like(s, 8.0)
    have, k = _group(bundle), _k(bundle)
    if group is None:
        if not (np.all(s == s[:, :1]) and np.all(z == z[:, :1])):
            return None
        s, z = s[:, :1], z[:, :1]
    else:
        if s.shape[1] != 1 and group != have and (have % group or k % group):
            return None  # other group boundaries (one group per row is every group size)
        per = 1 if s.shape[1] == 1 else have // group if group < have else 1  # new groups per old one
        groups = -(-k // group)
        s, z = np.repeat(s, per, axis=1), np.repeat(z, per, axis=1)  # sub-groups of one grid: exact
        s, z = np.broadcast_to(s, (s.shape[0], max(groups, s.shape[1])))[:, :groups], \
            np.broadcast_to(z, (z.shape[0], max(groups, z.shape[1])))[:, :groups]
    if not _integral(z, 15) or not _same_grid(s, z, 4):
        return None
    return packing.unpack_int4(bundle["weight"]).numpy(), s, z


def divisor_group(name: str, k: int, group: int | None) -> int | None:
    """The int4g group size to write for K = k inputs: `group`, or gcd(group, k) when a last group
    would be partial. FastLLM's grouped int4 matmul (CPU, ftllm 1.9.0) scales a partial last group's
    zero-point term by the full group size, so its output is wrong (SmolLM2, K = 576, int4g128: logits
    off by hundreds); groups that divide K keep bestiary's codes exactly, each (s, z) repeated."""
    if group is None or k <= group or k % group == 0:
        return group
    sub = math.gcd(group, k)
    print(f"{name}: int4g{group} written as int4g{sub} ({k} inputs: FastLLM miscomputes a partial last "
          "group)", file=sys.stderr)
    return sub


def _same_grid(s: np.ndarray, z: np.ndarray, bits: int) -> bool:
    """True when FastLLM reads the zero points back from grid_bounds(s, z) (and s to a rounding)."""
    lo, hi = grid_bounds(s, z, bits)
    s2, z2 = low_bit_grid(lo, hi, bits)
    return bool(np.array_equal(z2, z) and np.allclose(s2, s, rtol=1e-5, atol=0))


# ---- FastLLM's quantization ----------------------------------------------------------------------


def fastllm_quantize(w: np.ndarray, bits: int, group: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] float32 -> (codes uint8 [N, K], mins [N, g], maxs [N, g]) by FastLLM's rule, g groups of
    `group` along K (None: one per row); the (min, max) written are the group's own (0 included)."""
    n, k = w.shape
    g = k if group is None else group
    groups = -(-k // g)
    padded = np.zeros((n, groups * g), dtype=np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, groups, g)
    mins, maxs = blocks.min(axis=-1), blocks.max(axis=-1)
    s, z = low_bit_grid(mins, maxs, bits)
    safe = np.where(s > 0, s, 1).astype(np.float32)
    q = np.floor(blocks / safe[..., None] + z[..., None] + np.float32(0.5))
    q = np.clip(q, 0, (1 << bits) - 1).astype(np.uint8).reshape(n, -1)[:, :k]
    return q, mins.astype(np.float32), maxs.astype(np.float32)


def _dequantized(codes: np.ndarray, mins: np.ndarray, maxs: np.ndarray, bits: int, group: int) -> np.ndarray:
    s, z = low_bit_grid(mins, maxs, bits)
    k = codes.shape[1]
    s = np.repeat(s, group, axis=1)[:, :k]
    z = np.repeat(z, group, axis=1)[:, :k]
    return (codes.astype(np.float32) - z) * s


def _report(name: str, dtype: str, w: np.ndarray, back: np.ndarray, exact_possible: bool) -> None:
    err = np.abs(back - w)
    rel = float(np.linalg.norm(back - w) / max(float(np.linalg.norm(w)), 1e-12))
    why = "quantized" if not exact_possible else "re-quantized"
    print(f"{name}: {why} to {dtype} by FastLLM's rule: max |error| {float(err.max()):.3g}, relative {rel:.3%}",
          file=sys.stderr)


# ---- bytes ---------------------------------------------------------------------------------------


def _header(name: str, dims: tuple[int, ...], code: int) -> bytes:
    return pack_string(name) + pack_int(len(dims), *dims, code)


def _bounds(mins: np.ndarray, maxs: np.ndarray) -> bytes:
    return np.stack([mins.reshape(-1), maxs.reshape(-1)], axis=1).astype("<f4").tobytes()


def codes_and_bounds(name: str, bundle, dtype: str, bits: int, group: int | None):
    """(codes uint8 [N, K], mins, maxs) of a Linear weight: bestiary's codes where exact, else FastLLM's
    quantization of the float weight (the error it adds printed)."""
    quantized = "weight" in bundle
    exact = None if not quantized else exact_int8(bundle) if bits == 8 else exact_int4(bundle, group)
    if exact is not None:
        codes, s, z = exact
        return (codes, *grid_bounds(s, z, bits))
    w = float_of(bundle).numpy()
    codes, mins, maxs = fastllm_quantize(w, bits, group)
    _report(name, dtype, w, _dequantized(codes, mins, maxs, bits, group or w.shape[1]), quantized)
    return codes, mins, maxs


def tensor_parts(name: str, bundle, dtype: str) -> list:
    """The .flm bytes of one tensor, in pieces to write one after the other (no joined copy):
    name, dims, type, (quantization header), data."""
    if dtype in ("float32", "float16"):
        t = float_of(bundle) if "value" not in bundle or bundle["value"].dtype == torch.bfloat16 else bundle["value"]
        target = torch.float32 if dtype == "float32" else torch.float16
        values = np.ascontiguousarray(t.to(target).numpy())  # at most one copy of the tensor
        return [_header(name, tuple(values.shape), CODES[dtype]), values.data.cast("B")]
    group = parse_group(dtype)
    if dtype not in ("int8", "int4") and group is None:
        raise ValueError(f"--flm_dtype {dtype!r}")
    bits = 8 if dtype == "int8" else 4
    group = divisor_group(name, _k(bundle) if "weight" in bundle else bundle["value"].shape[-1], group)
    codes, mins, maxs = codes_and_bounds(name, bundle, dtype, bits, group)
    n, k = codes.shape
    if bits == 8:
        return [_header(name, (n, k), CODES["int8"]) + pack_int(0) + _bounds(mins, maxs),
                np.ascontiguousarray(codes).data.cast("B")]
    if group is None:
        head = _header(name, (n, k), CODES["int4"]) + pack_int(0)
    else:  # a row shorter than a group is one group of its length (FastLLM's kernels want group <= K)
        head = _header(name, (n, k), CODES["int4g"]) + pack_int(0, -(-k // group), min(group, k))
    return [head + _bounds(mins, maxs), pack_nibbles(codes)]
