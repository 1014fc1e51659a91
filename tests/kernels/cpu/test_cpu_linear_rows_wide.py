"""Several input rows on the row-tiled GEMV (core/kernels/cpu/linear_rows.c: `wide_rows` on the AVX-512
builds, `dense_rows` elsewhere): a verification step of speculative decoding runs 1 + k rows through
every linear, and each row must come out as it does alone (the float32 target's greedy outputs equal
plain decoding's only if so).

Shapes on purpose: m across the groups of 3 inputs and past 12 (a second sweep of the tile), k over
several 256-feature chunks with a short last one, n over several tiles, 1 and 2 threads (rows split
between them on whole tiles)."""

from __future__ import annotations

import pytest
import torch

from bestiary.core.format import packing
from bestiary.core.kernels.cpu import build, ops

pytestmark = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                reason="no C compiler (or BESTIARY_CPU_KERNELS=off): the kernels are not built")

ROWS_M = [2, 3, 4, 5, 7, 8, 12, 13, 26]


@pytest.fixture(autouse=True)
def kernels(cpu_build):
    """Every test runs on each ISA's build (skipped where this CPU lacks the ISA)."""
    return cpu_build


def _rows_alone(x: torch.Tensor, pw: ops.PackedWeight, bias: torch.Tensor) -> torch.Tensor:
    """Each input row through the kernel on its own (the decode step's 1-row GEMV)."""
    return torch.cat([ops.linear(x[i : i + 1], pw, bias, out_dtype=torch.float32) for i in range(x.shape[0])])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("wdtype,k", [(torch.float32, 592), (torch.bfloat16, 608)])
def test_float_tiles_give_every_row_as_alone(wdtype, k, threads, monkeypatch):
    """float32 / bfloat16 weights in row tiles, float32 inputs: y = x W^T + b to float32 summation
    error (against float64), and every row bit for bit its 1-row result, for every m."""
    monkeypatch.setattr(ops, "_threads", lambda: threads)
    gen = torch.Generator().manual_seed(k + threads)
    n = 48  # 6 tiles of 8 rows
    w = torch.randn(n, k, generator=gen).to(wdtype)
    pw = ops.PackedWeight.tiled(packing.pack_float_tiled(w))
    bias = torch.randn(n, generator=gen)
    for m in ROWS_M:
        x = torch.randn(m, k, generator=gen)
        y = ops.linear(x, pw, bias, out_dtype=torch.float32)
        ref = x.double() @ w.double().t() + bias.double()
        assert (y.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item(), m
        assert torch.equal(y, _rows_alone(x, pw, bias)), m


@pytest.mark.parametrize("threads", [1, 2])
def test_int8_tiles_with_float_inputs_give_every_row_as_alone(threads, monkeypatch):
    """int8 weights in row tiles (KIND_I8T) x float32 inputs (a float32 W8A16 engine's linears):
    equal bit for bit to the row-major layout's results and to each row alone, for every m."""
    monkeypatch.setattr(ops, "_threads", lambda: threads)
    gen = torch.Generator().manual_seed(7 + threads)
    n, k = 80, 608
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) + 0.1
    pw = ops.PackedWeight.int8(q, scale)
    assert pw.kind == ops.KIND_I8T
    plain = ops.PackedWeight(ops.KIND_I8, q, n, k, pw.scale)
    bias = torch.randn(n, generator=gen)
    for m in ROWS_M:
        x = torch.randn(m, k, generator=gen)
        y = ops.linear(x, pw, bias, out_dtype=torch.float32)
        ref = x.double() @ (q.double() * scale.double()[:, None]).t() + bias.double()
        assert (y.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item(), m
        assert torch.equal(y, ops.linear(x, plain, bias, out_dtype=torch.float32)), m
        assert torch.equal(y, _rows_alone(x, pw, bias)), m


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_int4_weights_give_every_row_as_alone(xdtype, cpu_build):
    """int4 weights (group 64; the dot layout on the AVX-512 + BF16 build, tile by tile with every input
    against a tile, core/kernels/cpu/linear_int4.c): the float32 reference to float32 summation error and
    every row bit for bit its 1-row result, for m across and past the 4-input groups (a W4A16 draft
    engine's first step of a round catches up the accepted tokens as rows)."""
    gen = torch.Generator().manual_seed(3)
    n, k, group = 42, 384, 64  # 10 tiles of 4 rows and 2 rows alone
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // group, generator=gen) + 0.1
    pw = ops.PackedWeight.int4(packed, scale, None, group)
    plain = ops.PackedWeight(ops.KIND_I4, packed, n, k, scale, (scale * 8.0).contiguous(), group)
    bias = torch.randn(n, generator=gen)
    for m in ROWS_M:
        x = torch.randn(m, k, generator=gen).to(xdtype)
        y = ops.linear(x, pw, bias, out_dtype=torch.float32)
        read = ops.q16_round(x) if ops.reads_q16(x, pw) else x  # (the avx2 build's quads: bf16 x in 16-bit integers)
        ref = ops.linear_ref(read, plain, bias, out_dtype=torch.float32)
        assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-6, m
        assert torch.equal(y, _rows_alone(x, pw, bias)), m
