"""Weight quantizers and packed layouts (pure torch, no kernels).

Checkpoint layouts (weights keep the checkpoint's (out_features N, in_features K) orientation):

int8 per output channel (W8A16, and the weights of W8A8_SQ_PER_CHANNEL):
    weight int8 [N, K];  weights_scaling_factor [N];  W8A16 imported asymmetric: zeros [N], w ~ (q - z) * s
    s[n] = max_k |w[n, k]| / 127,   q = clamp(round(w / s), -127, 127),   w ~ q[n, k] * s[n]

int4 group-wise (W4A16 and the AWQ/GPTQ imports), group size G, groups = ceil(K / G) (a
K that G does not divide has a shorter last group, as GPTQ's g_idx = k // G allows):
    weight uint8 [N, K / 2], two 4-bit codes per byte, low nibble first (the layout of
        core.kernels.woq_gemm):  weight[n, j] = q[n, 2j] | (q[n, 2j + 1] << 4),  q in 0..15
    weights_scaling_factor [N, groups];  zeros [N, groups] or absent
    w ~ (q[n, k] - z[n, k // G]) * s[n, k // G]
    symmetric (no zero point): z = 8,  s = max|w| / 7 over the group,  q = clamp(round(w / s), -8, 7) + 8
    asymmetric: s = (max w - min w) / 15,  z = clamp(round(-min w / s), 0, 15) (an integer, stored as float;
                tuned scales make it any float, core.convert.tune),  q = clamp(round(w / s) + z, 0, 15)

fp8 per tensor (FP8): weight float8_e4m3fn [N, K];  weights_scaling_factor [] (scalar)
    s = max|w| / 448,   q = fp8(w / s),   w ~ q * s

The CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`) wants its own layout; `pack_int4_cpu`
/ `unpack_int4_cpu` convert codes to and from it (see their docstrings), and
`int4_cpu_scale_zeros` builds its [K / G, N, 2] (scale, offset) table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import torch

INT8_MAX = 127
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# --- int8 per channel --------------------------------------------------------------------


QUANT_ROWS = 4096  # rows rounded at a time: the float32 temporaries of a 49152-row lm_head stay small
P = ParamSpec("P")
R = TypeVar("R", bound=tuple[Any, ...])  # a quantizer's outputs: tensors with N rows, or None


def by_rows(
    quantize: Callable[Concatenate[torch.Tensor, P], R],
) -> Callable[Concatenate[torch.Tensor, P], R]:
    """`quantize(w [N, K], ...)` run on blocks of QUANT_ROWS rows, its tensor arguments with N rows (a
    per-row amax) cut the same way, and its outputs (tensors with N rows, or None) concatenated: the
    same values (rows are rounded independently), with temporaries the size of a block."""
    run: Callable[..., R] = quantize  # called below with each argument cut to the block's rows

    def blocked(w: torch.Tensor, /, *args: P.args, **kwargs: P.kwargs) -> R:
        n = w.shape[0]
        if n <= QUANT_ROWS:
            return quantize(w, *args, **kwargs)

        def rows(a: object, i: int) -> object:
            return a[i:i + QUANT_ROWS] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == n else a

        parts = [run(w[i:i + QUANT_ROWS], *(rows(a, i) for a in args), **{k: rows(a, i) for k, a in kwargs.items()})
                 for i in range(0, n, QUANT_ROWS)]
        return cast(R, tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts)))

    functools.update_wrapper(blocked, quantize)  # functools.wraps, keeping blocked's own type
    return blocked


@by_rows
def quantize_int8_per_channel(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q int8 [N, K], s float32 [N]) with w ~ q * s[:, None], s = amax / 127.

    amax [N]: max |w| of each whole row, when w is a row-parallel rank's columns (its scales are
    then the tp 1 scales, the same on every rank); default w's own."""
    w = w.float()
    amax = w.abs().amax(dim=1) if amax is None else amax.float()
    s = amax.clamp(min=1e-12) / INT8_MAX  # [N]
    q = torch.round(w / s[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, s


def dequantize_int8(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
    """q int8 [N, K], s [N], z [N] or None (0) -> w float32 [N, K] = (q - z) * s."""
    if z is None:
        return q.float() * s.float()[:, None]
    return (q.float() - z.float()[:, None]) * s.float()[:, None]


TILE_ROWS, TILE_K = 8, 32  # the int8 tiled layout: rows per tile, features per block
FLOAT_TILE_BYTES = 64  # the float (bfloat16 / float32) row tiles: a row's bytes per block, a cache line


def int8_tiles_fit(n: int, k: int) -> bool:
    """True when an int8 weight [n, k] can be held in the tiled layout (pack_int8_tiled)."""
    return n % TILE_ROWS == 0 and k % TILE_K == 0


def pack_int8_tiled(q: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """int8 [N, K] -> the same codes in the tiled layout [N, K] the compiled GEMV reads (core.kernels.cpu):
    per tile of 8 rows, per block of 32 features, the 8 rows' 32 codes one after another, so a
    tile is one sequential stream (N % 8 == 0, K % 32 == 0). `in_place`: rewrite q's own memory
    (row_tiles_in_place) and return q."""
    return to_row_tiles(q, TILE_ROWS, TILE_K, in_place)


def unpack_int8_tiled(t: torch.Tensor) -> torch.Tensor:
    """The tiled layout [N, K] -> int8 [N, K] row-major (inverse of pack_int8_tiled)."""
    return row_tiles(t, TILE_ROWS, TILE_K, to_tiles=False)


def float_tile_k(dtype: torch.dtype) -> int:
    """Features per block of the float row tiles: 32 bfloat16, 16 float32 (64 bytes)."""
    return FLOAT_TILE_BYTES // torch.empty(0, dtype=dtype).element_size()


def float_tiles_fit(n: int, k: int, dtype: torch.dtype) -> bool:
    """True when a bfloat16 / float32 weight [n, k] can be held in row tiles (pack_float_tiled)."""
    return dtype in (torch.bfloat16, torch.float32) and n % TILE_ROWS == 0 and k % float_tile_k(dtype) == 0


def pack_float_tiled(w: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """bfloat16 / float32 W [N, K] -> the same values in row tiles [N, K] (core.kernels.cpu's DT_BF16T /
    DT_F32T): per tile of 8 rows, per block of 64 bytes of features (32 bfloat16, 16 float32),
    the 8 rows' blocks one after another. `in_place`: rewrite w's own memory (row_tiles_in_place)
    and return w."""
    return to_row_tiles(w, TILE_ROWS, float_tile_k(w.dtype), in_place)


def unpack_float_tiled(t: torch.Tensor) -> torch.Tensor:
    """Row tiles [N, K] -> W [N, K] row-major (inverse of pack_float_tiled)."""
    return row_tiles(t, TILE_ROWS, float_tile_k(t.dtype), to_tiles=False)


def row_tiles(t: torch.Tensor, rows: int, unit: int, to_tiles: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, C] with rows in order <-> rows in tiles of `rows` (the last one N % rows): per tile, per
    block of `unit` columns, its rows' blocks one after another (C % unit == 0). The int8 tiles
    (8 rows, 32 codes), the float tiles (8 rows, 64 bytes), the int4 dot layout's codes (4 rows,
    32 bytes) and scales (4 rows, 1). Written into `out` ([N, C] contiguous, any float dtype for
    float `t`) if given, else a new tensor; one strided copy per tile size."""
    n, width = t.shape
    whole = n - n % rows
    out = torch.empty_like(t) if out is None else out
    for start, stop, tile in ((0, whole, rows), (whole, n, n % rows)):  # the whole tiles, the short one
        if stop == start:
            continue
        in_order, tiled = (-1, tile, width // unit, unit), (-1, width // unit, tile, unit)
        src, dst = (in_order, tiled) if to_tiles else (tiled, in_order)
        out[start:stop].view(dst).copy_(t[start:stop].reshape(src).transpose(1, 2))
    return out


def to_row_tiles(t: torch.Tensor, rows: int, unit: int, in_place: bool) -> torch.Tensor:
    """row_tiles(t, rows, unit, to_tiles=True): into a new tensor, or (`in_place`) over t's own memory."""
    return row_tiles_in_place(t, rows, unit, to_tiles=True) if in_place else row_tiles(t, rows, unit, to_tiles=True)


REPACK_CHUNK_BYTES = 4 << 20  # row_tiles_in_place's scratch: a block of whole tiles at most this large


def row_tiles_in_place(t: torch.Tensor, rows: int, unit: int, to_tiles: bool) -> torch.Tensor:
    """row_tiles(t, rows, unit, to_tiles) written over t itself ([N, C] contiguous) and returned: a tile
    only permutes the values of its own `rows` rows, so t is rewritten a block of whole tiles (at most
    REPACK_CHUNK_BYTES) at a time from a scratch copy of that block. A load then holds the weight
    once, not its source and its tiles together (a tied 49152 x 576 float32 embedding: 108 MiB less
    at the peak)."""
    n, width = t.shape
    if not t.is_contiguous():
        raise ValueError(f"row_tiles_in_place needs a contiguous tensor, got strides {t.stride()}")
    step = max(rows, REPACK_CHUNK_BYTES // max(1, width * t.element_size()) // rows * rows)  # rows per block
    scratch = torch.empty(min(step, n) * width, dtype=t.dtype)  # [step * C], reused by every block
    for start in range(0, n, step):
        block = t[start:start + step]  # [<= step, C], contiguous
        source = scratch[: block.numel()].view_as(block).copy_(block)
        row_tiles(source, rows, unit, to_tiles, out=block)
    return t


# --- int4 group-wise ---------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] integers in 0..15 -> uint8 [N, K/2], low nibble = even k."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes uint8 [N, K] (inverse of pack_int4)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


DOT_BLOCK, DOT_ROWS = 64, 4  # the int4 dot layout: features per block of 32 bytes, rows per tile


def pack_int4_dot(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] (pack_int4's layout) -> the same codes in the dot layout [N, K/2] that the
    compiled vdpbf16ps GEMV reads (core.kernels.cpu): per block of 64 features, byte j = code(j) |
    code(32 + j) << 4, so each nibble plane holds 32 consecutive features (K % 64 == 0); rows in
    tiles of 4 (the last one N % 4), per tile the rows' 32 bytes of a block one after another."""
    n, k = packed.shape[0], packed.shape[1] * 2
    codes = unpack_int4(packed).view(n, k // DOT_BLOCK, 2, DOT_BLOCK // 2)  # [N, blocks, plane, 32]
    return row_tiles((codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k // 2), DOT_ROWS, 32, to_tiles=True)


def unpack_int4_dot(weight: torch.Tensor) -> torch.Tensor:
    """The dot layout [N, K/2] -> codes uint8 [N, K] (inverse of pack_int4_dot before packing)."""
    n, k = weight.shape[0], weight.shape[1] * 2
    blocks = row_tiles(weight, DOT_ROWS, 32, to_tiles=False).reshape(n, k // DOT_BLOCK, DOT_BLOCK // 2)  # [N, blocks, 32]
    return torch.stack((blocks & 15, blocks >> 4), dim=2).reshape(n, k)  # [N, blocks, plane, 32] -> [N, K]


QUAD_ROWS, QUAD_BYTES = 8, 4  # the int4 quads layout: rows per tile, bytes (8 features) of a row per quad


def pack_int4_quads(packed: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """uint8 [N, K/2] (pack_int4's layout) -> the same bytes in the quads layout [N, K/2] that the compiled
    int4 x int8 kernel reads (core.kernels.cpu, W4A8): rows in tiles of 8 (the last one N % 8), per tile,
    per 8 features, its rows' 4 bytes one after another, so that one 32-byte load holds 8 features of 8 rows,
    row r in 32-bit lane r, and a tile is one sequential stream. `in_place`: rewrite packed's own memory
    (row_tiles_in_place) and return it."""
    return to_row_tiles(packed, QUAD_ROWS, QUAD_BYTES, in_place)


def unpack_int4_quads(weight: torch.Tensor) -> torch.Tensor:
    """The quads layout [N, K/2] -> uint8 [N, K/2] in pack_int4's layout (inverse of pack_int4_quads)."""
    return row_tiles(weight, QUAD_ROWS, QUAD_BYTES, to_tiles=False)


@dataclass
class Int4Codes:
    """One int4 linear before packing: codes uint8 [N, K] (0..15), s and z float32 [N, groups] (z None: 8)."""

    codes: torch.Tensor
    s: torch.Tensor
    z: torch.Tensor | None
    group_size: int


def num_groups(k: int, group_size: int) -> int:
    """Groups of `group_size` input features covering k (the last one may be shorter)."""
    return -(-k // group_size)


def int4_grid(g: torch.Tensor, zero_point: bool, ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Groups g [..., G] -> (s [...], z [...] or None): the min/max grid of the group's range shrunk by
    `ratio` (1.0: the whole range). Symmetric s = max|w| r / 7 (z = 8 implied: None); asymmetric
    s = (max w - min w) r / 15, z = round(-min w r / s) (the range always includes 0)."""
    if zero_point:
        lo = g.amin(dim=-1).clamp(max=0.0) * ratio
        hi = g.amax(dim=-1).clamp(min=0.0) * ratio
        s = ((hi - lo) / 15).clamp(min=1e-12)
        return s, torch.round(-lo / s).clamp(0, 15)
    return (g.abs().amax(dim=-1) * ratio / 7).clamp(min=1e-12), None


def _int4_codes(w: torch.Tensor, group_size: int,
                zero_point: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [N, K] -> (codes float32 [N, groups, G] in 0..15, s [N, groups], z [N, groups] or None): round to
    nearest on `int4_grid`'s grid per group, q = clamp(round(w / s) + z, 0, 15) (symmetric: clamp(round(w / s),
    -8, 7) + 8), integers held exactly in float32. A short last group is padded with zeros, which every grid
    holds exactly."""
    n, k = w.shape
    groups = num_groups(k, group_size)
    g = torch.nn.functional.pad(w.float(), (0, groups * group_size - k)).reshape(n, groups, group_size)
    s, z = int4_grid(g, zero_point)  # [N, groups]; z is None exactly when not zero_point
    q = torch.round(g / s[..., None])  # [N, groups, G]
    if z is None:
        return q.clamp_(-8, 7).add_(8), s, None
    return q.add_(z[..., None]).clamp_(0, 15), s, z


@by_rows
def quantize_int4_groupwise(
    w: torch.Tensor, group_size: int, zero_point: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [N, K] -> (codes uint8 [N, K] in 0..15, s float32 [N, groups], z float32 [N, groups] or None).

    Round to nearest on `int4_grid`'s min/max grid per group (_int4_codes).
    (A per-group clip-ratio search for the least squared weight error was measured: 8-15% less
    weight error but a worse SmolLM2 perplexity, so round to nearest does not clip; GPTQ clips by
    the output error instead, core.quant.gptq.)"""
    n, k = w.shape
    codes, s, z = _int4_codes(w, group_size, zero_point)
    return codes.to(torch.uint8).reshape(n, -1)[:, :k], s, z


def int4_roundtrip(w: torch.Tensor, group_size: int, zero_point: bool) -> torch.Tensor:
    """w [N, K] -> its round-to-nearest int4 quantized-then-dequantized float32 [N, K]:
    dequantize_int4(*quantize_int4_groupwise(w, group_size, zero_point), group_size), bit for bit."""
    return _roundtrip_rows(w, group_size, zero_point)[0]


@by_rows
def _roundtrip_rows(w: torch.Tensor, group_size: int, zero_point: bool) -> tuple[torch.Tensor]:
    """int4_roundtrip of rows w [N, K]: (q - z) s group by group on _int4_codes' float codes, with no uint8
    codes or [N, K] copies of s and z (the AWQ and GPTQ searches run it for every candidate). q - z is exact on
    these small integers, so this rounds once, at the product dequantize_int4 rounds at."""
    n, k = w.shape
    codes, s, z = _int4_codes(w, group_size, zero_point)
    levels = codes.sub_(z[..., None] if z is not None else 8.0)
    return (levels.mul_(s[..., None]).reshape(n, -1)[:, :k].contiguous(),)


def dequantize_int4(
    codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """codes [N, K] (0..15), s/z [N, groups] -> w float32 [N, K] = (q - z[k // G]) * s[k // G] (z None: 8)."""
    q = codes.float()
    k = q.shape[1]
    scale = s.float().repeat_interleave(group_size, dim=1)[:, :k]
    zero = z.float().repeat_interleave(group_size, dim=1)[:, :k] if z is not None else 8.0
    return (q - zero) * scale


# --- the aten CPU int4 layout ------------------------------------------------------------


@functools.cache
def cpu_int4_block_n() -> int:
    """Rows per block of the aten CPU int4 layout: 64 where torch runs its AVX-512 kernels, else 32 (its AVX2
    and plain builds of `_convert_weight_to_int4pack_for_cpu`)."""
    return 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32


def _cpu_int4_check(n: int, k: int) -> None:
    if n % 16 or k % 2:
        raise ValueError(f"the CPU int4 layout needs out_features % 16 == 0 and even in_features, got [{n}, {k}]")


def pack_int4_cpu(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15, N % 16 == 0) -> uint8 [N, K/2] in the layout of
    `aten._convert_weight_to_int4pack_for_cpu`:

    rows in blocks of B = cpu_int4_block_n() (64 or 32), then one block of the remaining R = N % B rows, each
    block stored k-major. Full block, for each k, B/2 bytes: byte j = row j (low nibble) | row j + B/2 (high).
    Remainder block, for each k, R/2 bytes: byte j = row 2j (low) | row 2j + 1 (high).
    """
    n, k = codes.shape
    _cpu_int4_check(n, k)
    c = codes.to(torch.uint8)
    bn = cpu_int4_block_n()
    full = n // bn * bn
    blocks = c[:full].reshape(-1, bn, k).transpose(1, 2)  # [nb, K, B]
    head = blocks[..., : bn // 2] | (blocks[..., bn // 2 :] << 4)  # [nb, K, B/2]
    rest = c[full:].t()  # [K, R]
    tail = rest[:, 0::2] | (rest[:, 1::2] << 4)  # [K, R/2]
    return torch.cat([head.reshape(-1), tail.reshape(-1)]).view(n, k // 2)


def unpack_int4_cpu(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the aten CPU layout -> codes uint8 [N, K] (inverse of pack_int4_cpu)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    _cpu_int4_check(n, k)
    flat = packed.reshape(-1)
    bn = cpu_int4_block_n()
    full = n // bn * bn
    head = flat[: full * k // 2].view(-1, k, bn // 2)  # [nb, K, B/2]
    blocks = torch.cat([head & 0xF, head >> 4], dim=-1)  # [nb, K, B]
    tail = flat[full * k // 2 :].view(k, -1)  # [K, R/2]
    rest = torch.stack([tail & 0xF, tail >> 4], dim=-1).reshape(k, -1)  # [K, R]
    return torch.cat([blocks.transpose(1, 2).reshape(full, k), rest.t()])


def int4_cpu_scale_zeros(s: torch.Tensor, z: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """s, z [N, K/G] -> the aten CPU kernel's table [K/G, N, 2] of (scale, offset), in `dtype`.

    The kernel computes w = (q - 8) * scale + offset, so offset = (8 - z) * s (0 when symmetric).
    """
    offset = (8.0 - z.float()) * s.float() if z is not None else torch.zeros_like(s, dtype=torch.float32)
    return torch.stack([s.float().t(), offset.t()], dim=-1).to(dtype).contiguous()


# --- fp8 per tensor ----------------------------------------------------------------------


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (q float8_e4m3fn, s float32 scalar) with w ~ q * s."""
    s = (w.float().abs().amax().clamp(min=1e-12) / FP8_MAX)
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def dequantize_fp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q float8 [...], s scalar -> float32 q * s."""
    return q.float() * s.float()
