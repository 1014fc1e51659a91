"""The int4 x float linear on the quads layout (linear_int4q.c, KIND_I4Q: W4A16 on the avx2 build) against the
float32 reference (core.kernels.cpu.ops.linear_ref on the checkpoint layout), on every build this CPU runs (the
cpu_build fixture: the layout is chosen on avx2 only, but every build reads it).

float32 inputs (and the scalar build): float32 sums in a fixed order per row (4 accumulators by feature mod 4, a
group at a time, then the zero point and the scale), the same bits on every build. bfloat16 inputs on the vector
builds with K % 32 == 0: read as `q16_round(x)` (`reads_q16`), integer sums per 32- or 64-feature segment, exact.
Either way each row's bits depend neither on the batch, the tiles nor the threads. Shapes: batches across the
2-input tiles (1, 2, 3, 5, 16), K one quad of 8 features to 2,048 (and not a multiple of 32: the float path), a
short last group, N tails (not a multiple of the 8-row tile), groups of 32 to 192 (96: segments not aligned with
the 64-feature blocks), symmetric and zero points.
"""

from __future__ import annotations

import pytest
import torch
from a8_cases import assert_rows_do_not_depend_on_the_batch

from bestiary.core.format import packing
from bestiary.core.kernels.cpu import build, ops

pytestmark = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                reason="no C compiler (or BESTIARY_CPU_KERNELS=off): the kernels are not built")


def _weights(n: int, k: int, group: int, zp: bool, seed: int = 0) -> tuple[ops.PackedWeight, ops.PackedWeight]:
    """The same random int4 weight in the quads layout (KIND_I4Q) and in the checkpoint layout (KIND_I4)."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, groups, generator=gen) + 0.1
    zeros = torch.randint(0, 16, (n, groups), generator=gen).float() if zp else None
    return (ops.PackedWeight.int4(packing.pack_int4_quads(packed), scale, zeros, group, layout="quads"),
            ops.PackedWeight.int4(packed, scale, zeros, group, layout="checkpoint"))


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group,zp", [(1, 8, 8, 32, False), (2, 13, 96, 32, True), (3, 40, 200, 64, False),
                                            (5, 67, 576, 128, True), (16, 72, 384, 192, False),
                                            (1, 253, 2048, 128, True), (4, 16, 160, 96, True)])
def test_linear_int4q_matches_reference(cpu_build, m, n, k, group, zp, xdtype):
    quads, plain = _weights(n, k, group, zp, seed=m + n)
    assert quads.kind == ops.KIND_I4Q and torch.equal(packing.unpack_int4_quads(quads.weight), plain.weight)
    gen = torch.Generator().manual_seed(k)
    x, bias = (torch.randn(m, k, generator=gen) * 2).to(xdtype), torch.randn(n, generator=gen)
    y = ops.linear(x, quads, bias, out_dtype=torch.float32)
    q16 = ops.reads_q16(x, quads)
    assert q16 == (xdtype == torch.bfloat16 and cpu_build != "scalar" and k % 32 == 0)
    read = ops.q16_round(x) if q16 else x
    assert _rel_err(y, ops.linear_ref(read, plain, bias, out_dtype=torch.float32)) < 2e-6
    assert torch.equal(ops.linear(x, quads, bias, out_dtype=torch.bfloat16), y.bfloat16())  # rounded once
    torch.testing.assert_close(ops.dequantize(quads), ops.dequantize_ref(plain))
    torch.testing.assert_close(ops.dequantize_ref(quads), ops.dequantize_ref(plain), rtol=0, atol=0)


def test_linear_int4q_rows_do_not_depend_on_the_batch_or_threads(cpu_build):
    """Each input row gives the same float32 bits alone, in a slice of the batch and in the whole batch, on 1 and 2
    threads (200 rows: 25 tiles, split between the threads)."""
    assert_rows_do_not_depend_on_the_batch(_weights(200, 576, 64, True)[0])


def test_linear_int4q_is_the_same_bits_on_every_build(monkeypatch):
    """float32 inputs: the vector builds and the scalar one run the same float32 operations in the same order."""
    quads, _ = _weights(21, 320, 64, True)  # a short last tile of 5 rows, a short last group
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(2))
    outs = {}
    for isa in build.supported_isas():
        lib = build.library_for(isa)
        if lib is None:
            continue
        monkeypatch.setattr(ops, "library", lambda lib=lib: lib)
        outs[isa] = ops.linear(x, quads, out_dtype=torch.float32)
    assert "scalar" in outs and len(outs) >= 2, outs.keys()
    for isa, y in outs.items():
        assert torch.equal(y, outs["scalar"]), isa


def test_int4_layout_is_the_quads_on_the_avx2_build_only(cpu_build):
    """`PackedWeight.int4` packs the quads where this build's GEMV reads them (avx2, K % 8 == 0), the dot layout on
    avx512bf16 (K % 64 == 0), the checkpoint layout elsewhere; a bad layout name is refused."""
    expect = {"avx2": "quads", "avx512bf16": "dot"}.get(cpu_build, "checkpoint")
    assert ops.int4_layout(576) == expect
    assert ops.int4_layout(576, bfloat16=False) == ("checkpoint" if expect == "dot" else expect)
    assert ops.int4_layout(100) == "checkpoint"  # K % 8 != 0
    with pytest.raises(ValueError, match="layout 'tiles'"):
        ops.PackedWeight.int4(torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1), None, 32, layout="tiles")


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_linear_int4q_nan_row_is_nan_zero_row_is_zero(cpu_build, xdtype):
    """A NaN or an infinity in an input row makes that row's outputs NaN and no other's; an all-zero row gives
    exact zeros (no bias), on both paths."""
    quads, plain = _weights(24, 256, 64, True)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5)).to(xdtype)
    x[1, 70], x[3, 200], x[2] = float("nan"), float("inf"), 0.0
    y = ops.linear(x, quads, out_dtype=torch.float32)
    assert y[1].isnan().all() and y[3].isnan().all() and y[0].isfinite().all()
    assert torch.equal(y[2], torch.zeros(24))


def test_linear_int4q_extreme_codes_and_inputs_do_not_overflow(cpu_build):
    """Codes 15 against bfloat16 inputs at their block's largest code (q16: 2^14 <= |q| < 2^15) everywhere:
    the int32 sums of a 64-feature segment at their bound (64 x 15 x 32767) are exact."""
    n, k = 8, 256
    codes = torch.full((n, k), 15, dtype=torch.uint8)
    codes[1::2] = 0
    packed = packing.pack_int4_quads(packing.pack_int4(codes))
    pw = ops.PackedWeight.int4(packed, torch.ones(n, k // 64), torch.zeros(n, k // 64), 64, layout="quads")
    x = torch.full((2, k), 1.9921875).bfloat16()  # the bfloat16 just below 2: code 32640 of its block
    x[1] = -x[1]
    y = ops.linear(x, pw, out_dtype=torch.float32)
    expect = torch.tensor([15.0 * k * 1.9921875, 0.0] * 4)
    assert torch.equal(y[0], expect) and torch.equal(y[1], -expect)


@pytest.mark.parametrize("zp", [True, False])
def test_bfloat16_scale_tiles_give_the_float32_ones_bits(cpu_build, zp):
    """A checkpoint's bfloat16 s and z stay bfloat16 in the quads' tiles (ops.quads_scales: 4 bytes fewer per row and
    group to stream) and every path reads them exactly: the int4 x float GEMV (float32 inputs, and bfloat16 ones on
    q16), the int4 x int8 one (W4A8), on batches of 1 and 7, and dequantize, give the bits of float32 tiles of the same
    values. 21 rows: a short last tile; K 320 with groups of 128: a short last group."""
    gen = torch.Generator().manual_seed(5)
    n, k, group = 21, 320, 128
    codes = packing.pack_int4_quads(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen))
    scale = (torch.rand(n, 3, generator=gen) + 0.1).bfloat16()
    zeros = torch.randint(0, 16, (n, 3), generator=gen).bfloat16() if zp else None
    wide = zeros.float() if zp else None
    pairs = [(ops.PackedWeight.int4(codes, scale, zeros, group, layout="quads"),
              ops.PackedWeight.int4(codes, scale.float(), wide, group, layout="quads")),
             (ops.PackedWeight.int4_a8(codes, scale, zeros, group, quads=True),
              ops.PackedWeight.int4_a8(codes, scale.float(), wide, group, quads=True))]
    for short, full in pairs:
        assert short.scale.dtype == torch.bfloat16 and full.scale.dtype == torch.float32
        assert short.code == short.kind | ops.SCALES_BF16 and full.code == full.kind
        assert short.nbytes == full.nbytes - (short.scale.numel() + (short.scale_zero.numel() if zp else 0)) * 2
        for m in (1, 7):
            for xdtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=gen).to(xdtype)
                assert torch.equal(ops.linear(x, short, out_dtype=torch.float32),
                                   ops.linear(x, full, out_dtype=torch.float32)), (short.kind, m, xdtype)
        assert torch.equal(ops.dequantize(short), ops.dequantize(full))
        assert torch.equal(ops.dequantize_ref(short), ops.dequantize_ref(full))
    x = torch.randn(3, k, generator=gen)
    assert torch.equal(ops.linear_w4a8_ref(x, pairs[1][0]), ops.linear_w4a8_ref(x, pairs[1][1]))
