"""The int4 x int8 linear of the compiled CPU kernels (linear_w4a8.c, KIND_I4A8: W4A8 dynamic) against its
torch reference (core.kernels.cpu.ops.linear_w4a8_ref), on every build this CPU runs (the cpu_build fixture).

The integer part is exact in both (each segment's int32 dot product and code sum), and the float32 steps are
the same operations in the same order (the reference forms the last one's sum in float64 first: at most one
ulp apart, in practice the same bits). Shapes: batches across the 5-input tiles (1, 3, 4, 5, 13, 33), K from one
32-code chunk to 2,048 and not a multiple of 64 (a short last block), N tails (not a multiple of the 8-row
tile), groups of 32, 64 and 128 (and 96: segments not aligned with the blocks), symmetric and zero points.
"""

from __future__ import annotations

import pytest
import torch
from a8_cases import assert_rows_do_not_depend_on_the_batch, hard_inputs

from bestiary.core.format import packing
from bestiary.core.kernels.cpu import build, ops

pytestmark = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                reason="no C compiler (or BESTIARY_CPU_KERNELS=off): the kernels are not built")


@pytest.fixture(autouse=True)
def kernels(cpu_build):
    """Every test runs on each ISA's build (skipped where this CPU lacks the ISA)."""
    return cpu_build


def _weight(n: int, k: int, group: int, zero_point: bool, seed: int = 0) -> ops.PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    codes, s, z = packing.quantize_int4_groupwise(w, group, zero_point)
    return ops.PackedWeight.int4_a8(packing.pack_int4(codes), s, z, group)


def _close(y: torch.Tensor, ref: torch.Tensor, ulps: float = 2.0) -> bool:
    """Within `ulps` float32 ulps of the reference's largest value (NaN where it is NaN)."""
    y, ref = y.float(), ref.float()
    if not torch.equal(y.isnan(), ref.isnan()):
        return False
    ok = ~ref.isnan()
    bound = ulps * 2.0 ** -23 * max(ref[ok].abs().max().item(), 1e-30) if ok.any() else 0.0
    return (y[ok] - ref[ok]).abs().max().item() <= bound if ok.any() else True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group,zp", [(1, 8, 32, 32, False), (3, 13, 96, 32, True), (5, 40, 160, 64, False),
                                            (13, 67, 576, 128, True), (33, 72, 192, 96, False),
                                            (4, 128, 1536, 128, False), (2, 253, 2048, 64, True)])
def test_linear_w4a8_matches_reference(m, n, k, group, zp, dtype):
    pw = _weight(n, k, group, zp, seed=m + n)
    x, bias = hard_inputs(m, k, n, dtype)
    y = ops.linear(x, pw, bias, out_dtype=torch.float32)
    ref = ops.linear_w4a8_ref(x, pw, bias, out_dtype=torch.float32)
    assert _close(y, ref), (y - ref).abs().max()
    y16 = ops.linear(x, pw, bias, out_dtype=torch.bfloat16)  # the same float32 sums, rounded once
    assert torch.equal(y16, y.bfloat16())
    if m > 2:
        assert torch.equal(ops.linear(x, pw, out_dtype=torch.float32)[2], torch.zeros(n))
    # the float math it stands for: x's int8 reading times the dequantized weight (float32 rounding apart)
    dense = ops.a8_dequantize_ref(x) @ ops.dequantize_ref(pw).t() + bias
    assert (y - dense).abs().max() <= 1e-5 * dense.abs().max()


def test_linear_w4a8_segments():
    """Block (64) x group boundaries: 32 splits every block, 96 splits every other one."""
    assert ops.w4a8_segments(160, 64) == [(0, 64), (64, 64), (128, 32)]
    assert ops.w4a8_segments(128, 32) == [(0, 32), (32, 32), (64, 32), (96, 32)]
    assert ops.w4a8_segments(192, 96) == [(0, 64), (64, 32), (96, 32), (128, 64)]


def test_linear_w4a8_rows_do_not_depend_on_the_batch_or_threads():
    """Exact int32 segment sums, summed in a fixed order: each row's output is the same bits alone, in any batch
    (tiles of 1 to 4 inputs) and thread count."""
    assert_rows_do_not_depend_on_the_batch(_weight(72, 576, 64, True))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_linear_w4a8_nan_or_inf_row_is_nan_and_others_are_not(bad):
    pw = _weight(16, 128, 32, False)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    x[1, 70] = bad
    y = ops.linear(x, pw)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
    assert _close(y, ops.linear_w4a8_ref(x, pw))


def test_linear_w4a8_extreme_codes_do_not_saturate():
    """Codes 15 against +-127 everywhere: the int16 pair sums at their bound (2 chunks x 2 x 15 x 127)."""
    n, k = 8, 256
    codes = torch.full((n, k), 15, dtype=torch.uint8)
    codes[1::2] = 0
    pw = ops.PackedWeight.int4_a8(packing.pack_int4(codes), torch.ones(n, k // 64), torch.zeros(n, k // 64), 64)
    x = torch.ones(2, k)
    x[1] = -1.0
    y = ops.linear(x, pw)
    expect = torch.tensor([15.0 * k, 0.0] * 4)
    assert torch.equal(y[0], expect) and torch.equal(y[1], -expect)


def test_int4_a8_dequantizes_to_the_int4_weight():
    w = torch.randn(20, 96, generator=torch.Generator().manual_seed(3))
    codes, s, z = packing.quantize_int4_groupwise(w, 32, True)
    pw = ops.PackedWeight.int4_a8(packing.pack_int4(codes), s, z, 32)
    expect = packing.dequantize_int4(codes, s, z, 32)
    assert torch.allclose(ops.dequantize(pw), expect, atol=1e-6)


def test_int4_a8_refuses_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="K % 32 == 0"):
        ops.PackedWeight.int4_a8(torch.zeros(8, 24, dtype=torch.uint8), torch.ones(8, 2), None, 32)
    with pytest.raises(ValueError, match="group size multiple of 32"):
        ops.PackedWeight.int4_a8(torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 4), None, 16)
