"""The compiled CPU ops (kernels.c) as torch functions, each with its torch reference beside it.

    linear          y = x W^T (* s) + b for a small batch of rows (decode), W float32 /
                    bfloat16 / int8 per-channel / int4 group-wise (checkpoint layouts)
                    (KIND_I8A8: int8 row tiles x int8 activations quantized per row and block of
                    A8_BLOCK features, any number of rows: W8A8 dynamic, `linear_a8_ref`)
                    (KIND_I4A8: int4 codes in quads x the same int8 activations: W4A8 dynamic,
                    `linear_w4a8_ref`) (KIND_I4Q: the same quads x float activations, W4A16 on
                    the avx2 build; bfloat16 ones read as `q16_round(x)`)
    dequantize      the float W [N, K] a PackedWeight stands for (prefill GEMMs)
    decode_attention one query token per sequence over the paged KV pool (no gather); float
                    pools or INT8 / FP8 codes with their scales; per-sequence attention
                    windows and sinks (only the keys in the window are read)
    prefill_attention causal attention of a sequence's new queries over its keys (bfloat16,
                    the vector builds; the scalar build and float32 run torch's SDPA)
    kv_write        new keys and values into the pool's slots (as codes for INT8 / FP8 pools)
    rms_norm        y = rms_norm(x [+ residual]) (and the sum)
    rotary          RoPE in place with the step's cos / sin
    act_and_mul     act(fg[:, :I]) * fg[:, I:] for the fused gated-MLP output
    lora_rows_      out[t] += row t's own LoRA adapter's update (x A_a^T * s) B_a^T, in place
                    (the compiled decode plan's LoRA record; a row without adapter is left alone)

Every op computes in float32 and rounds its output once (on the avx512bf16 build, dot products
of two bfloat16 operands run vdpbf16ps: exact products, float32 sums; nothing is rounded that
the other builds keep, so the same references and tolerances hold). One exception: int8 weights
times bfloat16 inputs (and int4 quads times bfloat16 inputs) read the inputs as `q16_round(x)` on the vector
builds (16-bit integer dot products; exact within 2^7 of each 64-feature block's largest value, `reads_q16`). `supports(*tensors)` says whether
the compiled op can take them (CPU, float32 / bfloat16, library built); callers fall back to
the torch reference otherwise. Tensors must be contiguous unless a docstring says otherwise.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bestiary.core.format import packing
from bestiary.core.kernels.activations_ref import ACT_CODES, ACTIVATIONS
from bestiary.core.kernels.cpu.build import isa_name, library

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
KV_CODES = {torch.int8: 2, torch.float8_e4m3fn: 4}  # quantized KV pools (core.quant.kv): codes * scale
MAX_HEAD_DIM = 512  # decode_attention keeps a head's q, output and one K/V row in stack buffers
KIND_F32, KIND_BF16, KIND_I8, KIND_I4, KIND_I4D, KIND_I8T, KIND_BF16T, KIND_F32T = 0, 1, 2, 3, 5, 6, 7, 8
TILED_KINDS = {torch.bfloat16: KIND_BF16T, torch.float32: KIND_F32T}  # float weights in row tiles
KIND_I8A8 = 9  # linear_a8.c: KIND_I8T tiles x int8 activations quantized per row and block (W8A8 dynamic)
A8_BLOCK = 64  # linear_a8.c: input features per activation scale
A8_SUM_ROWS = 512  # PackedWeight.int8_a8: rows whose code sums are taken at a time (a multiple of the 8-row tiles)
KIND_I4A8 = 10  # linear_w4a8.c: int4 codes in quads x int8 activations quantized as KIND_I8A8's (W4A8 dynamic)
W4A8_CHUNK = 32  # linear_w4a8.c: K % 32 == 0; its segments are 32 or 64 features
KIND_I4Q = 11  # linear_int4q.c: KIND_I4's codes in the quads layout x float inputs (W4A16, the AVX2 build)
SCALES_BF16 = 256  # linear_w4a8.c W_SCALES_BF16: the flag of a KIND_I4A8 / KIND_I4Q code whose scale tiles are bfloat16
INT4_LAYOUTS = ("checkpoint", "dot", "quads")  # PackedWeight.int4's layouts: KIND_I4, KIND_I4D, KIND_I4Q


def supports(*tensors: torch.Tensor) -> bool:
    """True when the compiled ops can run on these (CPU, float32/bfloat16) tensors."""
    return all(t.device.type == "cpu" and t.dtype in DTYPES for t in tensors) and library() is not None


def _lib() -> ctypes.CDLL:
    """The loaded kernel library; RuntimeError when it is not built (callers check `supports` first)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the compiled CPU kernels are not available (core.kernels.cpu.build)")
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


# --- linear ----------------------------------------------------------------------------------


@dataclass
class PackedWeight:
    """A Linear's weight W [n, k] as the kernels read it (contiguous).

    kind KIND_F32 / KIND_BF16: weight = W^T [k, n] float (as the CPU Linear holds it).
    kind KIND_BF16T / KIND_F32T: weight = W [n, k] bfloat16 / float32 in row tiles
    (`packing.pack_float_tiled`, n % 8 == 0, k % 32 / 16 == 0): as KIND_I8T, one sequential
    stream per tile (~1.5x the transposed layout cache-cold).
    kind KIND_I8: weight int8 [n, k], W = q * scale[:, None], scale float32 [n].
    kind KIND_I8T: the same codes in the tiled layout (`packing.pack_int8_tiled`, n % 8 == 0,
    k % 16 == 0): each 8-row tile's GEMV reads one sequential stream (~1.9x the row-major one).
    kind KIND_I4: weight uint8 [n, k/2] (low nibble = even k), W[:, j] = q * s - s * z with
    s = scale [n, groups], s * z = scale_zero [n, groups] (float32), groups of `group` features.
    kind KIND_I4D: the same codes in the dot layout the AVX-512 + BF16 build reads with vdpbf16ps
    (`int4` packs it there when k % 64 == 0): per row, blocks of 64 features in 32 bytes, byte j
    of block b = code(64 b + j) | code(64 b + 32 + j) << 4, rows in tiles of 4 (`packing.pack_int4_dot`);
    scale and scale_zero in the same tiles, [groups][rows] per tile (`packing.row_tiles`).
    kind KIND_I4A8: KIND_I4's codes in the quads layout (`packing.pack_int4_quads`, k % 32 == 0: per tile
    of 8 rows, per 8 features, the rows' 4 bytes one after another) multiplied with int8 activations
    (`int4_a8`); scale = s and scale_zero = z itself in tiles of 8 rows [ceil(n / 8), groups, 8] (the last tile
    zero-padded), bfloat16 where the checkpoint's s and z are (`quads_scales`: the kernels widen them exactly, and a
    decode step streams 4 bytes fewer per row and group, ~6% of a g128 weight), else float32; scale_zero None when
    symmetric (z = 8: no stream of zero points to read).
    kind KIND_I4Q: KIND_I4's codes in the same quads layout (k % 8 == 0) multiplied with float inputs (`int4`
    packs it on the AVX2 build: one load for 8 features of 8 rows); scale = s and scale_zero = z, as KIND_I4A8's.
    bfloat16 inputs are read as `q16_round(x)` on the vector builds where k % 32 == 0 (`reads_q16`: 16-bit
    integer dot products), float32 ones as they are.
    """

    kind: int
    weight: torch.Tensor
    n: int
    k: int
    scale: torch.Tensor | None = None
    scale_zero: torch.Tensor | None = None
    group: int = 0

    @classmethod
    def transposed(cls, wt: torch.Tensor) -> PackedWeight:
        """A float32 / bfloat16 weight held transposed, wt = W^T [k, n] (contiguous)."""
        if not wt.is_contiguous():
            raise ValueError("PackedWeight.transposed: W^T must be contiguous")
        return cls(DTYPES[wt.dtype], wt, wt.shape[1], wt.shape[0])

    @classmethod
    def tiled(cls, tiles: torch.Tensor) -> PackedWeight:
        """A bfloat16 / float32 weight W [n, k] already in row tiles (`packing.pack_float_tiled`)."""
        n, k = tiles.shape
        if not tiles.is_contiguous() or not packing.float_tiles_fit(n, k, tiles.dtype):
            raise ValueError(f"PackedWeight.tiled: a contiguous bfloat16 [N % 8 == 0, K % 32 == 0] or float32 "
                             f"[N % 8 == 0, K % 16 == 0], not {tiles.dtype} {list(tiles.shape)}")
        return cls(TILED_KINDS[tiles.dtype], tiles, n, k)

    @classmethod
    def int8(cls, q: torch.Tensor, scale: torch.Tensor, tiled: bool | None = None) -> PackedWeight:
        """int8 q [n, k] with per-row scale [n]. tiled: True, `q` already is in the tiled layout;
        False, it is row-major and stays so; None, a copy is repacked into the tiled layout where
        `packing.int8_tiles_fit`."""
        n, k = q.shape
        if tiled is None:
            tiled = packing.int8_tiles_fit(n, k)
            q = packing.pack_int8_tiled(q) if tiled else q
        return cls(KIND_I8T if tiled else KIND_I8, q.contiguous(), n, k, scale.float().contiguous())

    @classmethod
    def int8_a8(cls, tiles: torch.Tensor, scale: torch.Tensor, correction: bool | None = None) -> PackedWeight:
        """int8 codes already in row tiles [n, k] (`packing.pack_int8_tiled`) with per-row scale [n], multiplied
        with int8 activations (KIND_I8A8, `linear_a8_ref`). scale_zero: 128 x each row's code sums per
        A8_BLOCK-feature block, float32, in row tiles [n / 8, blocks, 8]: the VNNI build's offset correction,
        computed when `correction` (None: only under the build that reads it, avx512bf16; the others leave it None)."""
        n, k = tiles.shape
        if tiles.dtype != torch.int8 or not packing.int8_tiles_fit(n, k):
            raise ValueError(f"PackedWeight.int8_a8: int8 row tiles [N % 8 == 0, K % 32 == 0], not {tiles.dtype} "
                             f"{list(tiles.shape)}")
        if not (bf16dot_build() if correction is None else correction):
            return cls(KIND_I8A8, tiles.contiguous(), n, k, scale.float().contiguous())
        step = A8_SUM_ROWS  # rows at a time: the int32 temporaries of a whole weight were 8x its codes (a load's peak)
        sums = torch.cat([a8_block_sums(packing.unpack_int8_tiled(tiles[i:i + step])) for i in range(0, n, step)])
        corr = (128.0 * sums.float()).view(n // packing.TILE_ROWS, packing.TILE_ROWS, -1).transpose(1, 2)
        return cls(KIND_I8A8, tiles.contiguous(), n, k, scale.float().contiguous(), corr.contiguous())

    @classmethod
    def int4(cls, packed: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None, group: int,
             layout: str | None = None) -> PackedWeight:
        """uint8 packed [n, k/2], scale [n, groups], zeros [n, groups] or None (symmetric: 8);
        group a multiple of 32 (the kernel's block). layout: "checkpoint" (KIND_I4), "dot" (KIND_I4D) or
        "quads" (KIND_I4Q), the layout `packed` already is in (kept as it is); None, `packed` is in the
        checkpoint layout and a copy is repacked into `int4_layout(k)`'s."""
        if group % 32:
            raise ValueError(f"int4 group size {group}: the compiled kernel needs a multiple of 32")
        if layout is not None and layout not in INT4_LAYOUTS:
            raise ValueError(f"PackedWeight.int4: layout {layout!r}, expected one of {INT4_LAYOUTS}")
        n, k = packed.shape[0], packed.shape[1] * 2
        if layout is None:
            layout = int4_layout(k)
            packed = {"dot": packing.pack_int4_dot, "quads": packing.pack_int4_quads}.get(layout, lambda p: p)(packed)
        if layout == "quads":  # (rows in tiles of 8, as the codes; z itself, None when symmetric)
            s_t, z_t = quads_scales(scale, zeros)
            return cls(KIND_I4Q, packed.contiguous(), n, k, s_t, z_t, group)
        s = scale.float().contiguous()
        sz = s * (zeros.float() if zeros is not None else 8.0)
        if layout == "dot":  # the scales of a tile's rows side by side
            s, sz = (packing.row_tiles(t, packing.DOT_ROWS, 1, to_tiles=True) for t in (s, sz))
        return cls(KIND_I4D if layout == "dot" else KIND_I4, packed.contiguous(), n, k, s, sz.contiguous(), group)

    @classmethod
    def int4_a8(cls, packed: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None, group: int,
                quads: bool = False) -> PackedWeight:
        """int4 codes uint8 packed [n, k/2] (k % 32 == 0) with scale [n, groups] and zeros [n, groups] or None
        (symmetric: 8), group % 32 == 0, multiplied with int8 activations (KIND_I4A8, `linear_w4a8_ref`).
        quads: True, `packed` already is in the quads layout (`packing.pack_int4_quads`: kept as it is);
        False, it is in the checkpoint layout and a repacked copy is taken."""
        n, k = packed.shape[0], packed.shape[1] * 2
        if packed.dtype != torch.uint8 or group % W4A8_CHUNK or k % W4A8_CHUNK:
            raise ValueError(f"PackedWeight.int4_a8: uint8 codes [N, K/2] with K % 32 == 0 and a group size multiple "
                             f"of 32, not {packed.dtype} {list(packed.shape)}, group {group}")
        s_t, z_t = quads_scales(scale, zeros)
        codes = packed.contiguous() if quads else packing.pack_int4_quads(packed)
        return cls(KIND_I4A8, codes, n, k, s_t, z_t, group)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.scale_zero) if t is not None)

    @property
    def code(self) -> int:
        """The weight-kind code bst_linear and bst_dequantize take: `kind`, with SCALES_BF16 where its scale tiles are
        bfloat16 (`quads_scales`)."""
        return _code(self.kind, self.scale)


def _code(kind: int, scale: torch.Tensor | None) -> int:
    return kind | SCALES_BF16 if scale is not None and scale.dtype == torch.bfloat16 else kind


def quads_scales(scale: torch.Tensor, zeros: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A quads weight's scales s [n, groups] and zero points z [n, groups] (None: symmetric) in tiles of 8 rows
    (`_row_tiles8`): bfloat16 when both are (the kernels read them exactly so), else float32."""
    keep = scale.dtype == torch.bfloat16 and (zeros is None or zeros.dtype == torch.bfloat16)
    dtype = torch.bfloat16 if keep else torch.float32
    return _row_tiles8(scale.to(dtype)), None if zeros is None else _row_tiles8(zeros.to(dtype))


def _row_tiles8(t: torch.Tensor) -> torch.Tensor:
    """[n, groups] -> [ceil(n / 8), groups, 8] (rows zero-padded to whole tiles of 8), contiguous."""
    n, groups = t.shape
    return F.pad(t, (0, 0, 0, -n % 8)).view(-1, 8, groups).transpose(1, 2).contiguous()


def _untile8(t: torch.Tensor, n: int) -> torch.Tensor:
    """`_row_tiles8`'s inverse: [ceil(n / 8), groups, 8] -> [n, groups]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def _i4a8_zeros(pw: PackedWeight, s: torch.Tensor) -> torch.Tensor:
    """A KIND_I4A8 / KIND_I4Q weight's zero points z [N, groups], beside its untiled scales s [N, groups] (8 where it is
    symmetric: scale_zero None)."""
    return torch.full_like(s, 8.0) if pw.scale_zero is None else _untile8(pw.scale_zero, pw.n).float()


def w4a8_fits(k: int, group: int) -> bool:
    """True when the W4A8 kernel (KIND_I4A8) takes an int4 weight of K input features and this group size."""
    return k % W4A8_CHUNK == 0 and group % W4A8_CHUNK == 0


def bf16dot_build() -> bool:
    """True when the loaded kernel library is the avx512bf16 build (vdpbf16ps, VNNI): the one that reads the
    int4 dot layout (KIND_I4D), the int8-activation VNNI corrections and runs bfloat16 prefill attention."""
    return isa_name(library()) == "avx512bf16"


def dot_layout_fits(k: int) -> bool:
    """True when this build packs int4 weights of K input features in the dot layout (KIND_I4D)."""
    return bf16dot_build() and k % packing.DOT_BLOCK == 0


def quads_layout_fits(k: int) -> bool:
    """True when this build multiplies float inputs by int4 weights of K input features in the quads layout
    (KIND_I4Q): the avx2 build (measured ~1.4x its checkpoint-layout GEMV there; the AVX-512 builds keep their
    own GEMVs), k % 8 == 0."""
    return isa_name(library()) == "avx2" and k % (2 * packing.QUAD_BYTES) == 0


def int4_layout(k: int, bfloat16: bool = True) -> str:
    """The layout `PackedWeight.int4` packs an int4 weight of K input features in on this build: "dot" where
    `dot_layout_fits` and the inputs are bfloat16 (float32 ones run faster on the checkpoint layout there),
    "quads" where `quads_layout_fits`, else "checkpoint"."""
    if dot_layout_fits(k) and bfloat16:
        return "dot"
    return "quads" if quads_layout_fits(k) else "checkpoint"


def linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x W^T + b: x [M, K] -> [M, N] in out_dtype (default x's). bias float32 [N] or None."""
    return _linear(x, pw.kind, pw.weight, pw.n, pw.k, pw.scale, pw.scale_zero, pw.group, bias, out_dtype)


def linear_t(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """y = x W^T for a float weight held transposed, wt = W^T [K, N] contiguous: x [M, K] -> [M, N]."""
    return _linear(x, DTYPES[wt.dtype], wt, wt.shape[1], wt.shape[0], None, None, 0, None, None)


def _linear(x, kind, w, n, k, scale, scale_zero, group, bias, out_dtype) -> torch.Tensor:
    if kind == KIND_I4D and not bf16dot_build():
        raise ValueError("an int4 weight in the dot layout needs the avx512bf16 kernel build (prepare it again)")
    if kind == KIND_I8A8 and scale_zero is None and bf16dot_build():
        raise ValueError("an int8 x int8 weight packed without its VNNI correction under the avx512bf16 kernel build "
                         "(prepare it again)")
    x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype)
    _lib().bst_linear(x.data_ptr(), DTYPES[x.dtype], m, k, w.data_ptr(), _code(kind, scale), n, _ptr(scale), _ptr(scale_zero),
                      group, _ptr(bias), out.data_ptr(), DTYPES[out.dtype], _threads())
    return out


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The int8 / int4 weight W [N, K] in `dtype` (float32 / bfloat16)."""
    if pw.kind not in (KIND_I8, KIND_I8T, KIND_I4, KIND_I4D, KIND_I8A8, KIND_I4A8, KIND_I4Q):
        raise ValueError("dequantize: only int8 / int4 weights")
    if pw.kind == KIND_I4A8:  # (its scales are tiled, its zero points plain)
        return dequantize_ref(pw).to(dtype)
    out = torch.empty(pw.n, pw.k, dtype=dtype)
    kind = KIND_I8T if pw.kind == KIND_I8A8 else pw.code  # the same tiles (its scale_zero: row sums, unused)
    _lib().bst_dequantize(pw.weight.data_ptr(), kind, pw.n, pw.k, _ptr(pw.scale), _ptr(pw.scale_zero),
                          pw.group, out.data_ptr(), DTYPES[dtype], _threads())
    return out


def dequantize_ref(pw: PackedWeight) -> torch.Tensor:
    """Torch reference of `dequantize`: W [N, K] float32."""
    w = pw.weight
    if pw.kind in (KIND_F32, KIND_BF16):
        return w.float().t()
    if pw.kind in (KIND_BF16T, KIND_F32T):
        return packing.unpack_float_tiled(w).float()
    if pw.scale is None:
        raise ValueError(f"dequantize_ref: a kind {pw.kind} (int8 / int4) weight without its scales")
    if pw.kind in (KIND_I8, KIND_I8T, KIND_I8A8):
        q = packing.unpack_int8_tiled(w) if pw.kind in (KIND_I8T, KIND_I8A8) else w
        return q.float() * pw.scale[:, None]
    if pw.kind in (KIND_I4A8, KIND_I4Q):
        s = _untile8(pw.scale, pw.n).float()
        sz = s * _i4a8_zeros(pw, s)
        w = packing.unpack_int4_quads(w)
    elif pw.scale_zero is None:
        raise ValueError(f"dequantize_ref: a kind {pw.kind} (int4) weight without its scale_zero")
    else:
        s, sz = pw.scale, pw.scale_zero  # [N, groups]
    if pw.kind == KIND_I4D:
        s, sz = (packing.row_tiles(t, packing.DOT_ROWS, 1, to_tiles=False) for t in (s, sz))
    codes = (packing.unpack_int4_dot(w) if pw.kind == KIND_I4D else packing.unpack_int4(w)).float()  # [N, K]
    s = s.repeat_interleave(pw.group, dim=1)[:, : pw.k]
    sz = sz.repeat_interleave(pw.group, dim=1)[:, : pw.k]
    return codes * s - sz


Q16_BLOCK = 64  # kernels.c: int8 weights x bfloat16 inputs read the inputs per block of 64 features


def reads_q16(x: torch.Tensor, pw: PackedWeight) -> bool:
    """True when `linear` reads x in 16-bit integers (kernels.c q16: int8 weights, or int4 quads with k % 32 == 0,
    bfloat16 x, a vector build); x then counts as `q16_round(x)`."""
    return (x.dtype == torch.bfloat16 and isa_name(library()) != "scalar"
            and (pw.kind == KIND_I8T or (pw.kind in (KIND_I8, KIND_I4Q) and pw.k % 32 == 0)))


def q16_round(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the int8 x bfloat16 GEMV reads it, float32: per block of Q16_BLOCK features,
    rounded (half to even) to a multiple of 2^(e - 15), where 2^(e - 1) <= the block's max |x| < 2^e.
    A block with a NaN or an infinity reads as NaN, an all-zero block (or one below 2^-101) as zeros."""
    xf = x.float()
    out = torch.empty_like(xf)
    for start in range(0, xf.shape[-1], Q16_BLOCK):
        block = xf[..., start:start + Q16_BLOCK]
        amax = block.abs().amax(-1, keepdim=True)
        _, e = torch.frexp(amax)
        step = torch.ldexp(torch.ones_like(amax), e - 15)
        rounded = torch.where((amax > 0) & (e >= -100), torch.round(block / step) * step, torch.zeros_like(block))
        out[..., start:start + Q16_BLOCK] = torch.where(amax.isfinite(), rounded, torch.full_like(block, float("nan")))
    return out


def a8_block_sums(codes: torch.Tensor) -> torch.Tensor:
    """int [.., K] -> its sums per A8_BLOCK features [.., ceil(K / A8_BLOCK)], int32 (the last block may be short)."""
    k = codes.shape[-1]
    padded = F.pad(codes.to(torch.int32), (0, -k % A8_BLOCK))
    return padded.view(*codes.shape[:-1], -1, A8_BLOCK).sum(-1, dtype=torch.int32)


def a8_quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], s float32 [M, blocks]) as linear_a8.c quantizes each input row, per block b
    of A8_BLOCK features (the last one may be short): s = max_b |x| / 127, q = round(x * (127 / max_b |x|))
    (float32, half to even), so x ~ q s. A block with a NaN or an infinity: s NaN (its row's outputs are
    NaN); an all-zero block: q = 0, s = 0."""
    m, k = x.shape
    g = F.pad(x.float(), (0, -k % A8_BLOCK)).view(m, -1, A8_BLOCK)  # [M, blocks, B]
    amax = g.abs().amax(-1, keepdim=True)  # [M, blocks, 1]
    ok = amax.isfinite() & (amax > 0)
    safe = torch.where(ok, amax, torch.ones_like(amax))
    inv = torch.where(ok, torch.full_like(amax, 127.0) / safe, torch.zeros_like(amax))  # (127.0 / t: 127 * (1 / t))
    q = torch.round(torch.nan_to_num(g, 0.0, 0.0, 0.0) * inv).clamp(-127, 127).to(torch.int8)
    s = torch.where(amax.isfinite(), amax / 127, torch.full_like(amax, float("nan")))
    return q.view(m, -1)[:, :k], s.squeeze(-1)


def a8_dequantize_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> what linear_a8.c multiplies, q * s per block (a8_quantize_ref), float32 [M, K]."""
    q, s = a8_quantize_ref(x)
    return q.float() * s.repeat_interleave(A8_BLOCK, dim=1)[:, : x.shape[1]]


def linear_a8_ref(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference of `linear` on a KIND_I8A8 weight, x [M, K] -> [M, N]:
    y = s_w sum_b s[:, b] (q_b W_b^T) + b, x's codes and block scales from `a8_quantize_ref`, each block's
    integer dot exact (int64), the rest in float64."""
    if pw.kind != KIND_I8A8 or pw.scale is None:
        raise ValueError(f"linear_a8_ref: a KIND_I8A8 weight with its scales, not kind {pw.kind}")
    q, s = a8_quantize_ref(x)
    codes = packing.unpack_int8_tiled(pw.weight).long()  # [N, K]
    y = torch.zeros(x.shape[0], pw.n, dtype=torch.float64)
    for b in range(s.shape[1]):
        cols = slice(b * A8_BLOCK, (b + 1) * A8_BLOCK)
        y += (q[:, cols].long() @ codes[:, cols].t()).double() * s[:, b:b + 1].double()  # [M, N]
    y = y * pw.scale.double()[None, :]
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or x.dtype)


def linear_ref(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference of `linear`, in float32: x [M, K] -> [M, N]."""
    return F.linear(x.float(), dequantize_ref(pw), bias).to(out_dtype or x.dtype)


# --- attention -------------------------------------------------------------------------------


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float, slopes: torch.Tensor | None = None,
                     kv_scales: torch.Tensor | None = None,
                     bounds: tuple[list[int], list[int]] | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax(q K^T * scale + slope_h (j - (L_b - 1))) V per sequence b over its kv_lens[b] keys.

    q [B, H, D]; pools [blocks, block_size, KVH, D]; tables int64 [B, max_blocks]; kv_lens int64 [B];
    slopes float32 [H] or None -> [B, H * D] in out_dtype (default q's). INT8 / FP8 pools (core.quant.kv) hold
    codes with K = code * kv_scales[0], V = code * kv_scales[1]. bounds: per-sequence (windows, sinks)
    (core.kernels.attention_window): only the keys in each window are read."""
    b, h, d = q.shape
    _, bs, kvh, _ = k_pool.shape
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d}: the compiled decode attention takes at most {MAX_HEAD_DIM}")
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()  # rows may be strided (q heads of a qkv tensor), heads must not
    tables, kv_lens = tables.contiguous(), kv_lens.contiguous()
    out = torch.empty(b, h * d, dtype=out_dtype or q.dtype)
    slopes = None if slopes is None else slopes.float().contiguous()
    kv_dt = kv_dtype_code(k_pool, kv_scales)
    kv_scales = None if kv_scales is None else kv_scales.float().contiguous()
    windows = None if bounds is None else torch.tensor(bounds, dtype=torch.int64)  # [2, B]
    _lib().bst_decode_attention(
        q.data_ptr(), DTYPES[q.dtype], q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), kv_dt,
        tables.data_ptr(), tables.shape[1], kv_lens.data_ptr(), b, h, kvh, d, bs, scale, _ptr(slopes),
        out.data_ptr(), DTYPES[out.dtype], _ptr(kv_scales), _ptr(windows), _threads())
    return out


PREFILL_MAX_HEAD_DIM = 256  # bst_prefill_attention keeps a block of rows of each head in stack buffers


def prefill_attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `prefill_attention` takes these: bfloat16 CPU tensors on a vector build (avx512bf16: vdpbf16ps;
    avx2 / avx512: float32 FMAs), head_dim % 32 == 0 and <= PREFILL_MAX_HEAD_DIM, heads and dims contiguous."""
    d = q.shape[-1]
    return (isa_name(library()) != "scalar" and d % 32 == 0
            and d <= PREFILL_MAX_HEAD_DIM and all(t.dtype == torch.bfloat16 and t.device.type == "cpu"
                                                 and t.stride(2) == 1 and t.stride(1) == d for t in (q, k, v)))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of n new queries over L >= n keys: q [n, H, D], k / v [L, KVH, D] (rows may be
    strided) -> [n, H * D]; query i sits at position L - n + i and sees keys j <= L - n + i.

    out[i, h] = softmax_j(q[i, h] . k[j, h / G] * scale) v[j, h / G], G = H / KVH: q . k products
    exact, float32 sums and softmax; p rounded to bfloat16 for p v (float32 sums), as torch's bf16 SDPA
    does; the output rounded once (`prefill_attention_fits`). Keys are taken in blocks of 16 from key 0, so a
    query's output does not depend on n (its prompt whole, in chunks or after a reused prefix)."""
    n, h, d = q.shape
    length, kvh, _ = k.shape
    if length < n or h % kvh or v.shape != k.shape:
        raise ValueError(f"prefill_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    out = torch.empty(n, h * d, dtype=q.dtype)
    _lib().bst_prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                 out.data_ptr(), n, length, h, kvh, d, scale, _threads())
    return out


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch reference of `prefill_attention`, in float32."""
    n, h, d = q.shape
    length = k.shape[0]
    visible = torch.ones(n, length, dtype=torch.bool).tril(length - n)  # [n, L]: key j <= L - n + i
    qf, kf, vf = (t.float().transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, rows, D]
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=visible, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(n, h * d).to(q.dtype)


def kv_dtype_code(pool: torch.Tensor, kv_scales: torch.Tensor | None) -> int:
    """kernels.c's dtype code of a KV pool: float32 / bfloat16 (no kv_scales), or int8 / e4m3fn codes
    (with kv_scales); ValueError for any other pool or a mismatch."""
    if (pool.dtype in KV_CODES) != (kv_scales is not None):
        raise ValueError(f"a {pool.dtype} KV pool {'needs' if kv_scales is None else 'takes no'} kv_scales")
    code = KV_CODES.get(pool.dtype, DTYPES.get(pool.dtype))
    if code is None:
        raise ValueError(f"KV pool dtype {pool.dtype}: expected float32, bfloat16, int8 or float8_e4m3fn")
    return code


def kv_write(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """Write k, v rows [T, KVH, D] into the pools' slots (int64 [T]; slot = block * block_size + offset),
    as codes of core.kernels.kv_codes.quantize_kv for INT8 / FP8 pools (kv_scales (s_k, s_v))."""
    t = k.shape[0]
    width = k_pool.shape[2] * k_pool.shape[3]
    k2, v2 = k.reshape(t, width), v.reshape(t, width)
    if k2.stride(1) != 1 or v2.stride(0) != k2.stride(0) or v2.dtype != k2.dtype:
        k2, v2 = k2.contiguous(), v2.contiguous().to(k2.dtype)  # rows of one stride, one dtype
    slots = slots.to(torch.int64).contiguous()
    kv_dt = kv_dtype_code(k_pool, kv_scales)
    kv_scales = None if kv_scales is None else kv_scales.float().contiguous()
    _lib().bst_kv_write(k2.data_ptr(), v2.data_ptr(), DTYPES[k2.dtype], k2.stride(0), k_pool.data_ptr(),
                        v_pool.data_ptr(), kv_dt, slots.data_ptr(), t, width, _ptr(kv_scales))


def decode_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                         kv_lens: torch.Tensor, scale: float, slopes: torch.Tensor | None = None,
                         kv_scales: torch.Tensor | None = None,
                         bounds: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
    """Torch reference of `decode_attention`, in float32."""
    from bestiary.core.kernels.attention_window import visible_keys

    b, h, d = q.shape
    bs, kvh = k_pool.shape[1], k_pool.shape[2]
    s_k, s_v = (1.0, 1.0) if kv_scales is None else (kv_scales[0].float(), kv_scales[1].float())
    outs = []
    for i in range(b):
        length = int(kv_lens[i])
        window, sinks = (0, 0) if bounds is None else (bounds[0][i], bounds[1][i])
        j = visible_keys(length - 1, length - 1, window, sinks)  # [L] key positions the query sees
        slots = tables[i, j // bs] * bs + j % bs
        k = k_pool.flatten(0, 1)[slots].float() * s_k  # [L, KVH, D]
        v = v_pool.flatten(0, 1)[slots].float() * s_v
        k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale  # [H, L]
        if slopes is not None:
            scores = scores + slopes.float()[:, None] * (j - (length - 1)).float()
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v).reshape(h * d))
    return torch.stack(outs).to(q.dtype)


# --- elementwise -----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = h / sqrt(mean(h^2) + eps) * w over the last dim, h = x (+ residual, rounded to x's dtype).

    x [..., H] -> y, or (y, h) when residual is given."""
    x = x.contiguous()
    y = torch.empty_like(x)
    h = None if residual is None else torch.empty_like(x)
    res = None if residual is None else residual.contiguous()
    t, hidden = x.numel() // x.shape[-1], x.shape[-1]
    _lib().bst_rms_norm(x.data_ptr(), _ptr(res), _ptr(h), y.data_ptr(), DTYPES[x.dtype], weight.data_ptr(),
                        DTYPES[weight.dtype], t, hidden, eps, _threads())
    return y if h is None else (y, h)  # h: None exactly without a residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `rms_norm`."""
    h = x if residual is None else x + residual
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if residual is None else (y, h)


def rotary_layout_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """True when `rotary` can take these views (heads and dims of x contiguous, cos / sin rows
    with a unit last stride and one row stride)."""
    return (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.stride(-1) == 1
            and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0) and cos.dtype == sin.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int, style: str) -> None:
    """Rotate the first rot_dim dims of x [T, n, D] in place (rows may be strided: the q|k heads
    of a qkv tensor; heads and dims contiguous) with cos / sin [T, 1, rot_dim/2] (rows may be
    strided: halves of one cos|sin tensor)."""
    t, n, d = x.shape
    shape = [t, 1, rot_dim // 2]  # the kernel reads exactly these: a smaller cos / sin would be read past its end
    if rot_dim % 2 or not 0 < rot_dim <= d or list(cos.shape) != shape or list(sin.shape) != shape:
        raise ValueError(f"rotary: cos and sin must be {shape} for x {list(x.shape)} and rot_dim {rot_dim}, "
                         f"got {list(cos.shape)} and {list(sin.shape)}")
    if not rotary_layout_ok(x, cos, sin):
        raise ValueError("rotary: heads and dims of x, and the last dim of cos / sin, must be contiguous")
    _lib().bst_rotary(x.data_ptr(), DTYPES[x.dtype], t, n, d, x.stride(0), cos.data_ptr(), sin.data_ptr(),
                      cos.stride(0), DTYPES[cos.dtype], rot_dim, int(style == "gptj"))


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int, style: str) -> None:
    """Torch reference of `rotary`: core.kernels.rotary's reference in float32, rounded once."""
    from bestiary.core.kernels.rotary import apply_rotary_ref

    xf = x.float()
    apply_rotary_ref(xf, cos.float(), sin.float(), rot_dim, style)
    x.copy_(xf)


def act_and_mul(fg: torch.Tensor, act: str) -> torch.Tensor:
    """act(f) * g for fg [T, 2I] = [f | g] -> [T, I] (act(f) rounded to fg's dtype first, as the
    torch reference computes it in that dtype)."""
    fg = fg.contiguous()
    t, i2 = fg.shape
    y = torch.empty(t, i2 // 2, dtype=fg.dtype)
    _lib().bst_act_and_mul(fg.data_ptr(), y.data_ptr(), DTYPES[fg.dtype], t, i2 // 2, ACT_CODES[act], _threads())
    return y


def act_and_mul_ref(fg: torch.Tensor, act: str) -> torch.Tensor:
    """Torch reference of `act_and_mul`."""
    f, g = fg.chunk(2, dim=-1)
    return ACTIVATIONS[act](f) * g


# --- LoRA rows -------------------------------------------------------------------------------


@dataclass
class LoraRows:
    """One linear site's adapters as bst_lora_rows reads them: per adapter, pieces each with its
    rank rows of `a` [R, K] and `scale` [R] (float32), its output columns n0 .. n0 + rows, and
    its B^T [rank, rows] at b_off of the flat `b`. `layout` int64: adapters + 1 piece starts,
    then (r0, rank, n0, rows, b_off) per piece. A piece keeps only the columns its B reaches
    (the zero rows of a q / k / v piece in a fused qkv are dropped); an adapter's pieces whose
    columns overlap are merged, so its pieces cover disjoint columns."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    layout: torch.Tensor
    adapters: int
    k: int
    n: int

    @classmethod
    def build(cls, per_adapter: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], k: int, n: int,
              dtype: torch.dtype) -> LoraRows:
        """From each adapter's pieces (a [r, K], b [N, r] in the site's columns, scale [r]);
        weights held in `dtype` (float32 / bfloat16)."""
        a_rows, b_flat, scales, starts, pieces = [], [], [], [0], []
        r0 = b_off = 0
        for adapter_pieces in per_adapter:
            for span in _merged_spans(adapter_pieces):
                a = torch.cat(span.a)
                bt = torch.cat(span.b, dim=1)[span.lo:span.hi].t().contiguous()  # [rank, rows]
                pieces.append((r0, a.shape[0], span.lo, span.hi - span.lo, b_off))
                a_rows.append(a)
                b_flat.append(bt.flatten())
                scales.append(torch.cat(span.scale))
                r0, b_off = r0 + a.shape[0], b_off + bt.numel()
            starts.append(len(pieces))
        layout = torch.tensor(starts + [v for piece in pieces for v in piece], dtype=torch.int64)
        return cls(_cat(a_rows, (0, k)).to(dtype).contiguous(), _cat(b_flat, (0,)).to(dtype).contiguous(),
                   _cat(scales, (0,)).float().contiguous(), layout, len(per_adapter), k, n)

    def pieces(self, adapter: int) -> list[tuple[int, ...]]:
        """(r0, rank, n0, rows, b_off) of each piece of `adapter`."""
        lay, first = self.layout.tolist(), self.adapters + 1
        return [tuple(lay[first + 5 * p : first + 5 * p + 5]) for p in range(lay[adapter], lay[adapter + 1])]


@dataclass
class _Span:
    """Output columns [lo, hi) that LoRA pieces of one adapter reach, with their a [r, K], b [N, r], scale [r]."""

    lo: int
    hi: int
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    scale: list[torch.Tensor]


def _merged_spans(adapter_pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[_Span]:
    """An adapter's pieces (a, b, scale) -> the spans of columns they reach, by column, the pieces whose
    columns overlap merged into one span (a piece whose B has no nonzero row, NaN counting, is dropped)."""
    spans = []
    for a, b, s in adapter_pieces:
        hit = (b != 0).any(dim=1).nonzero().flatten()
        if hit.numel():
            spans.append(_Span(int(hit[0]), int(hit[-1]) + 1, [a], [b], [s]))
    merged: list[_Span] = []
    for span in sorted(spans, key=lambda sp: sp.lo):
        if merged and span.lo < merged[-1].hi:  # overlapping columns: one piece
            last = merged[-1]
            last.hi = max(last.hi, span.hi)
            last.a += span.a
            last.b += span.b
            last.scale += span.scale
        else:
            merged.append(span)
    return merged


def _cat(tensors: list[torch.Tensor], empty: tuple[int, ...]) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(empty)


def lora_rows_(x: torch.Tensor, rows: LoraRows, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, N] += row t's adapter idx[t]'s update on x [T, K] (none for idx < 0), in place:
    out[t, n0:n0+rows] += ((x[t] A[r0:r0+rank]^T) * scale[r0:r0+rank]) B_p^T per piece, float32
    sums rounded once. idx int64 [T]. The torch reference: lora_rows_ref (and, from the adapters
    themselves, core.lora.batch.StepLora.add_)."""
    _lib().bst_lora_rows(x.data_ptr(), DTYPES[x.dtype], x.shape[0], x.shape[1], rows.a.data_ptr(),
                         rows.b.data_ptr(), DTYPES[rows.a.dtype], rows.scale.data_ptr(),
                         rows.layout.data_ptr(), rows.adapters, idx.data_ptr(), out.data_ptr(),
                         DTYPES[out.dtype], out.shape[1], _threads())


def lora_rows_ref(x: torch.Tensor, rows: LoraRows, idx: torch.Tensor, out: torch.Tensor) -> None:
    """lora_rows_ in torch, row by row."""
    for t, adapter in enumerate(idx.tolist()):
        if not 0 <= adapter < rows.adapters:
            continue
        delta = torch.zeros(out.shape[1])
        for r0, rank, n0, width, b_off in rows.pieces(adapter):
            v = (rows.a[r0 : r0 + rank].float() @ x[t].float()) * rows.scale[r0 : r0 + rank]  # [rank]
            delta[n0 : n0 + width] += v @ rows.b[b_off : b_off + rank * width].float().view(rank, width)
        out[t] = (out[t].float() + delta).to(out.dtype)


# --- greedy sampling -------------------------------------------------------------------------


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of float32 x [B, V] -> int64 [B] (first index of the maximum; a NaN
    counts as the maximum). ~10x faster than torch's on a vocabulary row."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().bst_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), _threads())
    return out


def w4a8_segments(k: int, group: int) -> list[tuple[int, int]]:
    """The segments linear_w4a8.c sums apart, in order: the intersections of an A8_BLOCK activation block and a
    weight group, as (first feature, features) (32 or 64; k % 32 == 0, group % 32 == 0)."""
    bounds = sorted({*range(0, k, A8_BLOCK), *range(0, k, group), k})
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def linear_w4a8_ref(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference of `linear` on a KIND_I4A8 weight, x [M, K] -> [M, N]. With x's codes qx and block scales
    s_x from `a8_quantize_ref`, the weight's codes qw (0..15), scales s_w and zero points z, over the segments j
    of `w4a8_segments` in order (block b(j), group g(j)), from acc = 0:

        D = sum_{k in j} qx[t, k] qw[n, k],   X = sum_{k in j} qx[t, k]        (exact integers)
        e = float32(D - z[n, g] X)                                               (one rounding: fmaf)
        acc = float32(acc + float32(s_x[t, b] s_w[n, g]) e)                      (one rounding: fmaf)
        y[t, n] = acc + bias[n]

    as linear_w4a8.c computes it (here the last step's exact sum is formed in float64 and then rounded: the
    same bits but for a double rounding, which moves a value by at most one float32 ulp)."""
    if pw.kind != KIND_I4A8 or pw.scale is None:
        raise ValueError(f"linear_w4a8_ref: a KIND_I4A8 weight with its scales, not kind {pw.kind}")
    qx, sx = a8_quantize_ref(x)  # [M, K] int8, [M, blocks]
    qw = packing.unpack_int4(packing.unpack_int4_quads(pw.weight)).long()  # [N, K]
    sw = _untile8(pw.scale, pw.n).float()  # [N, groups]
    z = _i4a8_zeros(pw, sw)
    acc = torch.zeros(x.shape[0], pw.n, dtype=torch.float32)
    for start, width in w4a8_segments(pw.k, pw.group):
        cols, b, g = slice(start, start + width), start // A8_BLOCK, start // pw.group
        q = qx[:, cols].long()  # [M, width]
        d = (q @ qw[:, cols].t()).double()  # [M, N]
        e = (d - z[None, :, g].double() * q.sum(1, keepdim=True).double()).float()
        coef = sx[:, b:b + 1] * sw[None, :, g]  # [M, N] float32
        acc = (acc.double() + coef.double() * e.double()).float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype or x.dtype)
