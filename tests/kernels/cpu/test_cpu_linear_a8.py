"""The int8 x int8 linear of the compiled CPU kernels (linear_a8.c, KIND_I8A8: W8A8 dynamic) against its
torch reference (core.kernels.cpu.ops.linear_a8_ref), on every build this CPU runs (the cpu_build fixture).

The codes are exact (the reference computes the same float32 quantization per block of A8_BLOCK features
and an int64 dot product per block), so what is left is the float32 sum over the blocks and its scaling
(the reference: float64), and on the VNNI build the subtraction of the codes' offset (128 x the weight's
block sums, times the block scales). Shapes: batches across the 4-input tiles (1, 3, 5, 13, 33), K from one 32-code block to 2,048,
N of one tile to many, rows of zeros, NaN and a large outlier.
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


def _weight(n: int, k: int, seed: int = 0) -> ops.PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, s = packing.quantize_int8_per_channel(w)
    return ops.PackedWeight.int8_a8(packing.pack_int8_tiled(q), s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 8, 32), (3, 16, 64), (5, 40, 96), (13, 64, 576), (33, 72, 160),
                                   (4, 128, 1536), (2, 256, 2048)])
def test_linear_a8_matches_reference(m, n, k, dtype):
    pw = _weight(n, k, seed=m + n)
    x, bias = hard_inputs(m, k, n, dtype)
    for out_dtype in (torch.float32, dtype):
        y = ops.linear(x, pw, bias, out_dtype=out_dtype)
        ref = ops.linear_a8_ref(x, pw, bias, out_dtype=out_dtype)
        tol = 1e-5 if out_dtype == torch.float32 else 8e-3  # float32 sums; bf16: one rounding
        assert (y.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    if m > 2:
        assert torch.equal(ops.linear(x, pw, out_dtype=torch.float32)[2], torch.zeros(n))


def test_linear_a8_rows_do_not_depend_on_the_batch():
    """Exact int32 block sums, summed in a fixed order: each row's output is the same bits alone, in any batch
    and thread count."""
    assert_rows_do_not_depend_on_the_batch(_weight(64, 576))


def test_linear_a8_nan_row_stays_nan_and_others_do_not():
    pw = _weight(16, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    x[1, 5] = float("nan")
    y = ops.linear(x, pw)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()


def test_a8_codes_are_the_reference_rounding():
    """Hand-computed codes: max |x| = 2 -> 127 / 2 per unit, half to even at .5 (x * 63.5 = 0.5 * 127)."""
    x = torch.tensor([[2.0, -1.0, 1.0 / 127, 0.0, -2.0, 1.5 / 63.5]])
    q, s = ops.a8_quantize_ref(x)
    assert q.tolist() == [[127, -64, 0, 0, -127, 2]]  # -63.5 -> -64 (even), 0.5 -> 0, 1.5 -> 2
    assert s.item() == pytest.approx(2.0 / 127)
    x = torch.cat([torch.full((1, ops.A8_BLOCK), 1.0), torch.full((1, 32), 4.0)], dim=1)  # two blocks, one short
    q, s = ops.a8_quantize_ref(x)
    assert s.shape == (1, 2) and q.unique().tolist() == [127]  # each block has its own scale
    assert s.tolist() == [[pytest.approx(1 / 127), pytest.approx(4 / 127)]]


def test_int8_a8_refuses_untiled_shapes():
    with pytest.raises(ValueError, match="row tiles"):
        ops.PackedWeight.int8_a8(torch.zeros(12, 64, dtype=torch.int8), torch.ones(12))


def test_code_sums_are_taken_a_block_of_rows_at_a_time(monkeypatch):
    """PackedWeight.int8_a8 sums the codes per block A8_SUM_ROWS rows at a time (issue 52: the whole
    weight's int32 temporaries, 8x its codes, were W8A8's load peak): the same correction as all rows
    at once, and never more rows converted at once."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (88, 200), generator=gen, dtype=torch.int8)[:, :192].contiguous()  # [88, 192]
    s = torch.rand(88, generator=gen) + 0.5
    whole = ops.PackedWeight.int8_a8(packing.pack_int8_tiled(q), s, correction=True)
    seen: list[int] = []
    real = ops.a8_block_sums
    monkeypatch.setattr(ops, "a8_block_sums", lambda codes: seen.append(codes.shape[0]) or real(codes))
    monkeypatch.setattr(ops, "A8_SUM_ROWS", 16)
    blocked = ops.PackedWeight.int8_a8(packing.pack_int8_tiled(q), s, correction=True)
    assert seen == [16] * 5 + [8] and torch.equal(blocked.scale_zero, whole.scale_zero)


def test_the_vnni_correction_is_computed_only_for_the_build_that_reads_it(cpu_build, monkeypatch):
    """Only the avx512bf16 (VNNI) build reads scale_zero: the others pack KIND_I8A8 without it (a float per 8 codes
    of memory less), and a weight packed so refuses to run under the VNNI build instead of reading a null pointer."""
    pw = _weight(16, 64)
    assert (pw.scale_zero is not None) == (cpu_build == "avx512bf16")
    bare = ops.PackedWeight.int8_a8(pw.weight, pw.scale, correction=False)
    monkeypatch.setattr(ops, "isa_name", lambda lib: "avx512bf16")
    with pytest.raises(ValueError, match="VNNI correction"):
        ops.linear(torch.randn(2, 64), bare)
