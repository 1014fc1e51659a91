"""The compiled CPU kernels (core/kernels/cpu/kernels.c) against their torch references (core.kernels.cpu.ops).

Each test runs on every build this CPU runs (AVX-512 + BF16, AVX-512, AVX2, scalar;
core.kernels.cpu.build.ISAS; the cpu_build fixture of tests/conftest.py).
Odd shapes on purpose: K not a multiple of 16 or 32 (masked tails), N not a multiple of the
row / column tiles, batches across the 4-row input tiles, GQA groups, blocks not dividing the
lengths, non-contiguous block tables.
"""

from __future__ import annotations

import pytest
import torch

from bestiary.core.format import packing
from bestiary.core.kernels.cpu import build, ops
from bestiary.core.kernels.kv_codes import as_bytes, quantize_kv

# skipped only where nothing can build the kernels: with a compiler, a kernels.c that does not build
# fails here (tests/kernels/cpu/test_cpu_isa.py::test_kernels_build_where_a_compiler_is) instead of skipping
pytestmark = pytest.mark.skipif(build.compiler() is None or not build.enabled(),
                                reason="no C compiler (or BESTIARY_CPU_KERNELS=off): the kernels are not built")

FLOAT = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def kernels(cpu_build):
    """Every test runs on each ISA's build (skipped where this CPU lacks the ISA)."""
    return cpu_build


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2  # bf16 output: one rounding of the result


def _weight(kind: str, n: int, k: int, gen: torch.Generator) -> ops.PackedWeight:
    w = torch.randn(n, k, generator=gen)
    if kind in ("f32", "bf16"):
        return ops.PackedWeight.transposed(w.t().contiguous().to(torch.float32 if kind == "f32" else torch.bfloat16))
    if kind == "i8":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        return ops.PackedWeight.int8(q, torch.rand(n, generator=gen) + 0.1)
    group = 32 if kind == "i4_g32_zp" else 64
    groups = -(-k // group)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, groups, generator=gen) + 0.1
    zeros = torch.randint(0, 16, (n, groups), generator=gen).float() if kind.endswith("zp") else None
    return ops.PackedWeight.int4(packed, scale, zeros, group)


@pytest.mark.parametrize("kind", ["f32", "bf16", "i8", "i4_g64", "i4_g32_zp"])
@pytest.mark.parametrize("m", [1, 2, 5, 9])
@pytest.mark.parametrize("n,k", [(200, 576), (49, 100), (1000, 70)])
@pytest.mark.parametrize("xdtype", FLOAT)
def test_linear_matches_reference(kind, m, n, k, xdtype):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    pw = _weight(kind, n, k, gen)
    x = torch.randn(m, k, generator=gen).to(xdtype)
    bias = torch.randn(n, generator=gen)
    y = ops.linear(x, pw, bias)
    ref = ops.linear_ref(x, pw, bias)
    assert y.dtype == xdtype and y.shape == (m, n)
    assert _rel_err(y, ref) < _tol(xdtype)
    # each row is the same whatever the batch it comes in (batch-invariant GEMV)
    torch.testing.assert_close(ops.linear(x[-1:], pw, bias), y[-1:], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["i8", "i4_g64", "i4_g32_zp"])
@pytest.mark.parametrize("dtype", FLOAT)
def test_dequantize_matches_reference(kind, dtype):
    pw = _weight(kind, 48, 100, torch.Generator().manual_seed(1))
    # q * s - s z may be one fused multiply-add in C: equal to float rounding
    torch.testing.assert_close(ops.dequantize(pw, dtype), ops.dequantize_ref(pw).to(dtype))


def test_int4_dot_layout_round_trips():
    """pack_int4_dot: byte j of each 64-feature block holds features j (low) and 32 + j (high); rows
    in tiles of 4 (here one whole tile and one of 2 rows), a tile's blocks row after row."""
    codes = torch.randint(0, 16, (6, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # the checkpoint layout: low nibble = even k
    dot = packing.pack_int4_dot(packed).flatten()

    def byte(r: int, b: int, j: int) -> int:
        return codes[r, 64 * b + j].item() | (codes[r, 64 * b + 32 + j].item() << 4)

    assert dot[32 * 1 + 5].item() == byte(1, 0, 5)  # tile 0, block 0, row 1
    assert dot[128 * 1 + 32 * 3 + 7].item() == byte(3, 1, 7)  # tile 0, block 1, row 3
    assert dot[4 * 64 + 64 * 1 + 32 * 1 + 9].item() == byte(5, 1, 9)  # the short tile: block 1, its row 1
    assert torch.equal(packing.unpack_int4_dot(packing.pack_int4_dot(packed)), codes)
    assert torch.equal(packing.unpack_int4_dot(packing.pack_int4_dot(packed[:3])), codes[:3])


def test_int8_tiled_layout_round_trips():
    """pack_int8_tiled: per tile of 8 rows, per block of 32 features, the 8 rows' 32 codes in turn."""
    q = torch.randint(-127, 128, (16, 96), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    t = packing.pack_int8_tiled(q).flatten()
    assert t[32 * 3 + 5].item() == q[3, 5].item()  # tile 0, block 0, row 3
    assert t[256 + 32 * 2 + 7].item() == q[2, 32 + 7].item()  # tile 0, block 1, row 2
    assert t[8 * 96 + 256 * 2 + 32 * 6 + 1].item() == q[8 + 6, 64 + 1].item()  # tile 1, block 2, row 6
    assert torch.equal(packing.unpack_int8_tiled(packing.pack_int8_tiled(q)), q)
    assert packing.int8_tiles_fit(16, 96) and not packing.int8_tiles_fit(12, 96) and not packing.int8_tiles_fit(16, 80)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("xdtype", FLOAT)
def test_int8_tiled_layout_matches_the_row_major_layout(m, xdtype):
    """int8 weights with N % 8 == 0 and K % 32 == 0 are held in row tiles (KIND_I8T): the same
    sums in the same order as the row-major layout, so the outputs are equal bit for bit, on every
    build; `dequantize` reads the layout too."""
    gen = torch.Generator().manual_seed(m)
    n, k = 72, 224  # 9 tiles; 7 blocks of 32 features (3 blocks of 64 inputs, then 32)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) + 0.1
    pw = ops.PackedWeight.int8(q, scale)
    plain = ops.PackedWeight(ops.KIND_I8, q, n, k, pw.scale)
    assert pw.kind == ops.KIND_I8T and ops.PackedWeight.int8(q[:12], scale[:12]).kind == ops.KIND_I8
    x = torch.randn(m, k, generator=gen).to(xdtype)
    bias = torch.randn(n, generator=gen)
    y = ops.linear(x, pw, bias, out_dtype=torch.float32)
    assert torch.equal(y, ops.linear(x, plain, bias, out_dtype=torch.float32))
    read = ops.q16_round(x) if ops.reads_q16(x, pw) else x  # bf16 x: 16-bit integers on the vector builds
    assert ops.reads_q16(x, plain) == ops.reads_q16(x, pw)
    assert _rel_err(y, ops.linear_ref(read, plain, bias, out_dtype=torch.float32)) < 1e-5
    torch.testing.assert_close(ops.dequantize(pw), ops.dequantize_ref(plain))
    torch.testing.assert_close(ops.dequantize_ref(pw), ops.dequantize_ref(plain))


@pytest.mark.parametrize("dtype,unit", [(torch.bfloat16, 32), (torch.float32, 16)])
def test_float_tiled_layout_round_trips(dtype, unit):
    """pack_float_tiled: per tile of 8 rows, per block of 64 bytes of features (32 bfloat16, 16
    float32), the 8 rows' blocks in turn."""
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(6)).to(dtype)
    t = packing.pack_float_tiled(w).flatten()
    assert t[unit * 3 + 5].item() == w[3, 5].item()  # tile 0, block 0, row 3
    assert t[8 * unit + unit * 2 + 7].item() == w[2, unit + 7].item()  # tile 0, block 1, row 2
    assert t[8 * 96 + 8 * unit * 2 + unit * 6 + unit - 1].item() == w[8 + 6, 3 * unit - 1].item()  # tile 1, block 2, row 6
    assert torch.equal(packing.unpack_float_tiled(packing.pack_float_tiled(w)), w)
    assert packing.float_tiles_fit(16, 96, dtype) and not packing.float_tiles_fit(12, 96, dtype)
    assert packing.float_tiles_fit(16, 80, dtype) == (dtype == torch.float32)  # 80 = 5 x 16, not a multiple of 32
    assert not packing.float_tiles_fit(16, 96, torch.float16)
    with pytest.raises(ValueError, match=r"^PackedWeight.tiled: a contiguous bfloat16 \[N % 8 == 0, K % 32 == 0\] or "
                                         rf"float32 \[N % 8 == 0, K % 16 == 0\], not {dtype} \[12, 96\]$"):
        ops.PackedWeight.tiled(w[:12])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("xdtype", FLOAT)
@pytest.mark.parametrize("wdtype", FLOAT)
def test_float_tiled_layout_equals_the_float32_reference(m, xdtype, wdtype):
    """bfloat16 / float32 weights in row tiles (KIND_BF16T / KIND_F32T; bfloat16 x bfloat16: one
    vdpbf16ps per row and 32 features on the AVX-512 + BF16 build, FMAs elsewhere): equal to the
    float32 reference to float32 summation error (float32 output: no bfloat16 rounding hides an
    error), bias added per row; every row the same bit for bit whatever the batch (each input alone)."""
    gen = torch.Generator().manual_seed(40 + m)
    n, k = 40, 160  # 5 tiles; 5 / 10 blocks of 32 / 16 features
    w = torch.randn(n, k, generator=gen).to(wdtype)
    pw = ops.PackedWeight.tiled(packing.pack_float_tiled(w))
    assert pw.kind == {torch.bfloat16: ops.KIND_BF16T, torch.float32: ops.KIND_F32T}[wdtype]
    x = torch.randn(m, k, generator=gen).to(xdtype)
    bias = torch.randn(n, generator=gen)
    y = ops.linear(x, pw, bias, out_dtype=torch.float32)
    ref = x.double() @ w.double().t() + bias.double()
    assert (y.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    for i in range(m):
        assert torch.equal(ops.linear(x[i : i + 1], pw, bias, out_dtype=torch.float32), y[i : i + 1])
    torch.testing.assert_close(ops.dequantize_ref(pw), w.float(), rtol=0, atol=0)
    yb = ops.linear(x, pw)  # the input's dtype out: one rounding of the float32 result
    assert yb.dtype == xdtype and torch.equal(yb, ops.linear(x, pw, out_dtype=torch.float32).to(xdtype))


@pytest.mark.parametrize("group,zp", [(32, True), (64, False), (128, True), (192, False)])
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("xdtype", FLOAT)
def test_int4_dot_layout_matches_the_checkpoint_layout(cpu_build, group, zp, m, xdtype):
    """On the AVX-512 + BF16 build int4 weights with K % 64 == 0 are packed in the dot layout
    (KIND_I4D): bfloat16 inputs run vdpbf16ps on the codes as bfloat16 16 + q (exact), float32
    inputs an FMA path; both equal the float32 reference to float32 summation error (output
    float32: no bfloat16 rounding hides an error), each row the same in any batch, and
    `dequantize` reads the layout (codes and scales in 4-row tiles) too. The other builds keep
    KIND_I4 (the avx2 build: the quads, KIND_I4Q, its own test)."""
    gen = torch.Generator().manual_seed(group + m)
    n, k = 37, 384  # n: 9 tiles of 4 rows and one row alone; 384 = 2 groups of 192
    groups = -(-k // group)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, groups, generator=gen) + 0.1
    zeros = torch.randint(0, 16, (n, groups), generator=gen).float() if zp else None
    pw = ops.PackedWeight.int4(packed, scale, zeros, group)
    assert pw.kind == {"avx512bf16": ops.KIND_I4D, "avx2": ops.KIND_I4Q}.get(cpu_build, ops.KIND_I4)
    x = (torch.randn(m, k, generator=gen) * 2).to(xdtype)
    bias = torch.randn(n, generator=gen)
    y = ops.linear(x, pw, bias, out_dtype=torch.float32)
    z = zeros if zp else torch.full_like(scale, 8.0)
    plain = ops.PackedWeight(ops.KIND_I4, packed, n, k, scale, (scale * z).contiguous(), group)  # the checkpoint layout
    read = ops.q16_round(x) if ops.reads_q16(x, pw) else x  # (the avx2 build's quads: bf16 x in 16-bit integers)
    ref = ops.linear_ref(read, plain, bias, out_dtype=torch.float32)
    assert _rel_err(y, ref) < 2e-6
    assert torch.equal(ops.linear(x[-1:], pw, bias, out_dtype=torch.float32), y[-1:])  # batch-invariant rows
    torch.testing.assert_close(ops.dequantize(pw), ops.dequantize_ref(plain))


@pytest.mark.parametrize("zp", [False, True])
def test_int4_rows_decoded_once_for_a_batch_equal_each_row_alone(cpu_build, zp):
    """From 5 inputs on, int4_rows decodes each 8-row block once for the whole batch (int4_decode_rows): every
    row of a 13-input batch equals the same input alone (the per-tile GEMV), bit for bit, with a K tail past the
    last vector block, a short last group and N not a multiple of 8; and the batch matches the reference."""
    gen = torch.Generator().manual_seed(7)
    n, k, group = 21, 200, 32  # 200 = 6 groups of 32 + 8; 21 rows = 2 blocks of 8 + 5
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, -(-k // group), generator=gen) + 0.1
    zeros = torch.randint(0, 16, scale.shape, generator=gen).float() if zp else None
    pw = ops.PackedWeight.int4(packed, scale, zeros, group)
    x = torch.randn(13, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    y = ops.linear(x, pw, bias, out_dtype=torch.float32)
    for i in range(13):
        assert torch.equal(ops.linear(x[i:i + 1], pw, bias, out_dtype=torch.float32), y[i:i + 1]), i
    assert _rel_err(y, ops.linear_ref(x, pw, bias, out_dtype=torch.float32)) < 2e-6


def _wide_range_inputs(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 x [m, k] whose values span 2^-12 .. 2^4 within each block: q16 rounds the small ones."""
    return (torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-12, 4, (m, k), generator=gen).float())).bfloat16()


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("k", [576, 96])  # whole 64-feature blocks; one, then a last block of 32
def test_int8_weights_read_bf16_inputs_as_16_bit_integers(m, tiled, k, cpu_build):
    """int8 W x bf16 x on the vector builds: x is read per 64-feature block as q16_round(x) (a
    multiple of 2^(e - 15), 2^(e - 1) <= the block's max |x| < 2^e) and summed exactly, so y is the
    float32 reference on q16_round(x) to float32 rounding, and within the stated bound of the
    reference on x: |error| <= sum_k |W[r, k]| max_block |x| 2^-15."""
    gen = torch.Generator().manual_seed(10 * m + k)
    n = 40
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) + 0.1
    pw = ops.PackedWeight.int8(q, scale, tiled=tiled)
    x = _wide_range_inputs(m, k, gen)
    y = ops.linear(x, pw, out_dtype=torch.float32)
    assert ops.reads_q16(x, pw) == (cpu_build != "scalar")
    if cpu_build == "scalar":  # no q16: the exact float path
        assert _rel_err(y, ops.linear_ref(x, pw, out_dtype=torch.float32)) < 1e-5
        return
    read = ops.q16_round(x)
    assert not torch.equal(read, x.float())  # the inputs do exercise the rounding
    assert _rel_err(y, ops.linear_ref(read, pw, out_dtype=torch.float32)) < 2e-6
    exact = ops.linear_ref(x, pw, out_dtype=torch.float32)
    blocks = [x.float()[:, b:b + 64].abs().amax(-1, keepdim=True).expand(m, min(64, k - b)) for b in range(0, k, 64)]
    block_max = torch.cat(blocks, -1)  # [m, k]: each feature's block max
    bound = (q.float().abs() * scale[:, None]) @ (block_max * 2.0**-15).t()  # [n, m]
    assert ((y - exact).abs() <= bound.t() * 1.01 + 1e-4).all()
    torch.testing.assert_close(ops.linear(x[-1:], pw, out_dtype=torch.float32), y[-1:], rtol=0, atol=0)


def test_q16_keeps_bf16_inputs_within_2_to_the_7_of_their_block_max_exact():
    """A bf16 value has an 8-bit significand: every value of a block at least 2^-7 of the block's
    largest power of two is a multiple of 2^(e - 15) (exact); zero blocks stay zero; a NaN or an
    infinity makes its block NaN."""
    gen = torch.Generator().manual_seed(3)
    sign = torch.randint(0, 2, (3, 128), generator=gen).float() * 2 - 1
    x = sign * (1 + torch.rand(3, 128, generator=gen)) * torch.exp2(torch.randint(-7, 0, (3, 128), generator=gen).float())
    x[:, ::7] = 1.0  # each block's max is in [1, 2): all of its values, 2^-7 .. 2, are kept
    x = x.bfloat16()
    assert torch.equal(ops.q16_round(x), x.float())
    special = torch.zeros(3, 128).bfloat16()
    special[1, 70] = float("inf")
    special[1, 3] = 5.0
    special[2, :64] = 2.0**-110  # below 2^-101: read as zeros; the next block is not
    special[2, 64:] = 2.0**-90
    read = ops.q16_round(special)
    assert torch.equal(read[0], torch.zeros(128)) and read[1, :64].tolist() == special[1, :64].float().tolist()
    assert read[1, 64:].isnan().all()
    assert torch.equal(read[2, :64], torch.zeros(64)) and torch.equal(read[2, 64:], special[2, 64:].float())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int8_bf16_linear_lets_a_nan_or_infinity_through(bad, cpu_build):
    """A NaN or an infinity in an input row leaves none of that row's outputs finite (NaN on the q16
    path, inf or NaN on the float one); the other rows, an all-zero row and a row of values below
    2^-101 are unharmed."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (16, 128), dtype=torch.int8, generator=gen)
    pw = ops.PackedWeight.int8(q, torch.rand(16, generator=gen) + 0.1)
    x = torch.randn(4, 128, generator=gen).bfloat16()
    x[1, 100] = bad
    x[2] = 0
    x[3] = 2.0**-110  # q16 reads it as zeros; the float path adds ~1e-31 to the bias
    bias = torch.randn(16, generator=gen)
    y = ops.linear(x, pw, bias, out_dtype=torch.float32)
    assert not y[1].isfinite().any()
    assert torch.equal(y[2], bias) and torch.equal(y[3], bias)
    assert _rel_err(y[0], ops.linear_ref(x[:1], pw, bias, out_dtype=torch.float32)[0]) < 1e-4


def test_linear_t_is_linear_on_a_transposed_weight():
    gen = torch.Generator().manual_seed(2)
    wt = torch.randn(70, 33, generator=gen).bfloat16()  # W^T [K, N]
    x = torch.randn(3, 70, generator=gen).bfloat16()
    ref = (x.float() @ wt.float()).bfloat16()
    torch.testing.assert_close(ops.linear_t(x, wt), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize("n,k", [(200, 576), (1000, 71), (47, 2)])
def test_bf16_inputs_and_weights_sum_in_float32(m, n, k):
    """bf16 x and W, float32 out: each product is exact and the sums are float32 on every build
    (avx512bf16's vdpbf16ps too: the inputs are bf16 already, nothing is rounded that the float32
    reference keeps), so y is the reference to float32 rounding (1e-5), not to bf16's (4e-3).
    Odd k (a last half pair), n past whole 32-column groups, batch-invariant rows."""
    gen = torch.Generator().manual_seed(m + n + k)
    pw = _weight("bf16", n, k, gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    y = ops.linear(x, pw, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert _rel_err(y, ops.linear_ref(x, pw, out_dtype=torch.float32)) < 1e-5
    torch.testing.assert_close(ops.linear(x[-1:], pw, out_dtype=torch.float32), y[-1:], rtol=0, atol=0)


@pytest.mark.parametrize("d", [24, 64, 80])
def test_bf16_decode_attention_sums_in_float32(d):
    """bf16 q and pools, float32 out: q . k products exact, float32 sums on every build (avx512bf16:
    vdpbf16ps, with a masked tail where D is not a multiple of 32), so the output is the float32
    reference's to 1e-5."""
    gen = torch.Generator().manual_seed(d)
    blocks, bs, kvh, h = 10, 4, 2, 6
    k_pool = (torch.randn(blocks, bs, kvh, d, generator=gen) * 2).bfloat16()
    v_pool = torch.randn(blocks, bs, kvh, d, generator=gen).bfloat16()
    tables, kv_lens = torch.tensor([[3, 8, 1, 5], [0, 9, 2, 7]]), torch.tensor([15, 6])
    q = torch.randn(2, h, d, generator=gen).bfloat16()
    out = ops.decode_attention(q, k_pool, v_pool, tables, kv_lens, d**-0.5, out_dtype=torch.float32)
    ref = ops.decode_attention_ref(q.float(), k_pool, v_pool, tables, kv_lens, d**-0.5)  # float32
    assert out.dtype == torch.float32 and _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", FLOAT)
@pytest.mark.parametrize("alibi", [False, True])
def test_decode_attention_matches_reference(dtype, alibi):
    gen = torch.Generator().manual_seed(3)
    blocks, bs, kvh, d, h = 12, 5, 2, 24, 6  # G = 3 query heads per kv head; D not a multiple of 16
    k_pool = torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype)
    v_pool = torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype)
    tables = torch.tensor([[7, 2, 9, 0], [1, 4, 0, 0], [11, 3, 5, 6]])  # scattered blocks
    kv_lens = torch.tensor([13, 6, 20])
    qkv = torch.randn(3, h + 2 * kvh, d, generator=gen).to(dtype)
    q = qkv[:, :h]  # strided rows, as SelfAttention hands it over
    slopes = torch.rand(h, generator=gen) if alibi else None
    out = ops.decode_attention(q, k_pool, v_pool, tables, kv_lens, d**-0.5, slopes)
    ref = ops.decode_attention_ref(q, k_pool, v_pool, tables, kv_lens, d**-0.5, slopes)
    assert out.shape == (3, h * d)
    assert _rel_err(out, ref) < _tol(dtype)


@pytest.mark.parametrize("bounds", [None, ([0, 20, 9], [0, 3, 2])], ids=["full", "windows-sinks"])
def test_bf16_decode_attention_with_alibi_and_windows_matches_reference(bounds):
    """bf16 q and pools with D % 32 == 0 (the avx512bf16 build's 16-key score blocks): ALiBi's
    slope * (j - (L - 1)) uses each walked key's own position j, past a window's gap too (a sink, then
    keys from L - (W - S)), and keys past a short last block are not stored. 37 keys: two blocks of 16
    and 5."""
    gen = torch.Generator().manual_seed(41)
    blocks, bs, kvh, d, h = 14, 8, 2, 64, 6
    k_pool = torch.randn(blocks, bs, kvh, d, generator=gen).bfloat16()
    v_pool = torch.randn(blocks, bs, kvh, d, generator=gen).bfloat16()
    tables = torch.tensor([[9, 2, 12, 0, 5], [1, 4, 13, 7, 3], [11, 6, 10, 8, 0]])
    kv_lens = torch.tensor([37, 40, 19])
    q = torch.randn(3, h, d, generator=gen).bfloat16()
    slopes = torch.rand(h, generator=gen)
    out = ops.decode_attention(q, k_pool, v_pool, tables, kv_lens, d**-0.5, slopes, bounds=bounds,
                               out_dtype=torch.float32)
    ref = ops.decode_attention_ref(q.float(), k_pool, v_pool, tables, kv_lens, d**-0.5, slopes, bounds=bounds)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", FLOAT)
@pytest.mark.parametrize("h,kvh,d", [(4, 4, 64), (8, 2, 64), (10, 2, 128), (8, 1, 80), (6, 2, 72)])
def test_decode_attention_head_groups_equal_single_heads(h, kvh, d, dtype):
    """The kernel takes up to 4 query heads of a key head per task (G = 1, 4, 5 -> 4 + 1, 8 -> 4 + 4,
    3), with the sums of D in registers (64, 80: one walk over the keys; 128: two) or in memory (72).
    Each head's output is the reference's, and bit for bit what that head alone (G = 1) gives: the
    grouping changes no sum's order, nor does the batch (9 sequences against their first 3). One
    sequence of 1,100 keys (scores past the stack buffer)."""
    gen = torch.Generator().manual_seed(h * d + kvh)
    bs, blocks = 16, 80
    k_pool = torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype)
    v_pool = torch.randn(blocks, bs, kvh, d, generator=gen).to(dtype)
    b = 9
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:70] for _ in range(b)])  # scattered blocks
    kv_lens = torch.tensor([1100, 17, 1, 40, 3, 300, 64, 65, 16])
    q = torch.randn(b, h, d, generator=gen).to(dtype)
    out = ops.decode_attention(q, k_pool, v_pool, tables, kv_lens, d**-0.5)
    ref = ops.decode_attention_ref(q, k_pool, v_pool, tables, kv_lens, d**-0.5)
    assert _rel_err(out, ref) < _tol(dtype)
    assert torch.equal(ops.decode_attention(q[:3], k_pool, v_pool, tables[:3], kv_lens[:3], d**-0.5), out[:3])
    g = h // kvh
    for head in range(h):
        kv = head // g
        alone = ops.decode_attention(q[:, head : head + 1].contiguous(), k_pool[:, :, kv : kv + 1].contiguous(),
                                     v_pool[:, :, kv : kv + 1].contiguous(), tables, kv_lens, d**-0.5)
        assert torch.equal(alone, out.view(b, h, d)[:, head].reshape(b, d)), head


@pytest.mark.parametrize("n,length,h,kvh,d", [
    (1, 1, 2, 1, 32), (5, 5, 9, 3, 64), (37, 37, 4, 2, 32), (20, 50, 9, 3, 64), (16, 16, 8, 8, 128),
    (100, 133, 8, 1, 128), (33, 47, 2, 2, 256)])
def test_prefill_attention_matches_reference(kernels, n, length, h, kvh, d):
    """Causal prefill of n queries over `length` keys (the last n are the queries' own: a chunk after
    length - n cached tokens), G = h / kvh; strided rows as SelfAttention hands them over (the q, k
    and v heads of one qkv tensor). Blocks of 16 queries and keys with short tails. The vector builds run
    it (avx512bf16: vdpbf16ps; avx2 / avx512: float32 FMAs); on the scalar one `prefill_attention_fits` says no
    and SDPA runs."""
    gen = torch.Generator().manual_seed(n * length + d)
    qkv = torch.randn(length, h + 2 * kvh, d, generator=gen).bfloat16()
    q, k, v = qkv[length - n :, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
    if kernels == "scalar":
        assert not ops.prefill_attention_fits(q, k, v)
        return
    assert ops.prefill_attention_fits(q, k, v)
    out = ops.prefill_attention(q, k, v, d**-0.5)
    ref = ops.prefill_attention_ref(q.float(), k.float(), v.float(), d**-0.5)  # float32 throughout
    assert out.shape == (n, h * d) and out.dtype == torch.bfloat16
    # p rounded to bf16 for p.v, and the output once: measured <= 2.9e-3 over these cases, as torch's
    # SDPA in bf16 on the same inputs (<= 2.9e-3)
    assert _rel_err(out, ref) < 4e-3
    # query i sees keys <= length - n + i only: changing a later key leaves earlier queries alone
    k2 = k.clone()
    k2[-1] += 1
    v2 = v.clone()
    v2[-1] -= 1
    out2 = ops.prefill_attention(q, k2, v2, d**-0.5)
    assert torch.equal(out2[:-1], out[:-1]) and not torch.equal(out2[-1], out[-1])


def test_prefill_attention_fits_only_what_it_takes(kernels):
    qkv = torch.randn(8, 6, 64).bfloat16()
    q, k, v = qkv[:, :4], qkv[:, 4:5], qkv[:, 5:]
    vector = kernels != "scalar"
    assert ops.prefill_attention_fits(q, k, v) == vector
    assert not ops.prefill_attention_fits(q.float(), k.float(), v.float())  # bf16 only
    odd = torch.randn(8, 6, 48).bfloat16()
    assert not ops.prefill_attention_fits(odd[:, :4], odd[:, 4:5], odd[:, 5:])  # D % 32
    assert not ops.prefill_attention_fits(q.transpose(0, 1).contiguous().transpose(0, 1), k, v)  # strided heads
    if vector:
        with pytest.raises(ValueError, match="prefill_attention"):
            ops.prefill_attention(q, k[:4], v[:4], 0.1)  # fewer keys than queries


KV_CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("code_dtype", KV_CODE_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT)
def test_decode_attention_over_quantized_pools_matches_reference(code_dtype, dtype):
    gen = torch.Generator().manual_seed(13)
    blocks, bs, kvh, d, h = 10, 4, 2, 40, 4
    scales = torch.tensor([0.05, 0.02])
    k = torch.randn(blocks, bs, kvh, d, generator=gen) * 3
    v = torch.randn(blocks, bs, kvh, d, generator=gen)
    k_pool, v_pool = quantize_kv(k, scales[0], code_dtype), quantize_kv(v, scales[1], code_dtype)
    tables = torch.tensor([[3, 8, 1], [0, 9, 0]])
    kv_lens = torch.tensor([11, 5])
    q = torch.randn(2, h, d, generator=gen).to(dtype)
    out = ops.decode_attention(q, k_pool, v_pool, tables, kv_lens, d**-0.5, kv_scales=scales)
    ref = ops.decode_attention_ref(q, k_pool, v_pool, tables, kv_lens, d**-0.5, kv_scales=scales)
    assert _rel_err(out, ref) < _tol(dtype)
    # the codes are read with their scales: a float pool of the dequantized values agrees too
    deq = ops.decode_attention_ref(q, k_pool.float() * scales[0], v_pool.float() * scales[1], tables, kv_lens,
                                   d**-0.5)
    assert _rel_err(out, deq) < _tol(dtype)
    with pytest.raises(ValueError, match="needs kv_scales"):
        ops.decode_attention(q, k_pool, v_pool, tables, kv_lens, d**-0.5)


def test_decode_attention_refuses_heads_past_its_buffers():
    """Bug: a head_dim above 512 would have overrun the kernel's stack buffers; it is refused (the
    dispatcher and the decode plans check MAX_HEAD_DIM and run the torch path instead)."""
    d = ops.MAX_HEAD_DIM + 16
    pool = torch.zeros(2, 4, 1, d)
    with pytest.raises(ValueError, match="head_dim"):
        ops.decode_attention(torch.zeros(1, 1, d), pool, pool, torch.tensor([[0]]), torch.tensor([1]), 1.0)


@pytest.mark.parametrize("pool_dtype", KV_CODE_DTYPES + [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", FLOAT)
def test_kv_write_stores_the_codes_of_quantize_kv(pool_dtype, dtype):
    """Byte for byte what the eager path (core.quant.kv.quantize_kv / write_kv) stores."""
    gen = torch.Generator().manual_seed(14)
    blocks, bs, kvh, d = 6, 4, 2, 8
    scales = torch.tensor([0.25, 0.125]) if pool_dtype in KV_CODE_DTYPES else None
    qkv = torch.randn(5, 3, kvh, d, generator=gen) * 40  # beyond the int8 / e4m3 range: clamped
    qkv[0, 1, 0, :4] = torch.tensor([0.125, -0.375, 1.0 / 64, -0.0])  # ties and a negative zero
    qkv[0, 1, 1, :3] = torch.tensor([2 ** -10 * 0.25 * 3, 0.25 * 2 ** -9 * 0.5, 0.25 * 17.0])  # e4m3 ties
    qkv = qkv.to(dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # strided rows, as SelfAttention writes them
    slots = torch.tensor([0, 5, 13, 22, 7])
    pools = [torch.zeros(blocks, bs, kvh, d, dtype=pool_dtype) for _ in range(2)]
    ops.kv_write(k, v, pools[0], pools[1], slots, scales)
    for pool, x, i in ((pools[0], k, 0), (pools[1], v, 1)):
        want = x.float() if scales is None else quantize_kv(x, scales[i], pool_dtype)
        got = pool.view(pool.dtype).flatten(0, 1)[slots]
        assert torch.equal(as_bytes(got), as_bytes(want.to(pool_dtype))), (pool_dtype, i)
        assert int(as_bytes(pool).flatten(0, 1).count_nonzero(dim=(1, 2)).gt(0).sum()) <= len(slots)


@pytest.mark.parametrize("dtype", FLOAT)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(dtype, residual):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 300, generator=gen).to(dtype)
    w = torch.randn(300, generator=gen).to(dtype)
    res = torch.randn(5, 300, generator=gen).to(dtype) if residual else None
    got, ref = ops.rms_norm(x, w, 1e-5, res), ops.rms_norm_ref(x, w, 1e-5, res)
    if residual:
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)  # the sum, rounded to dtype
        got, ref = got[0], ref[0]
    assert _rel_err(got, ref) < _tol(dtype)


@pytest.mark.parametrize("dtype", FLOAT)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rotary_matches_reference(dtype, style):
    gen = torch.Generator().manual_seed(5)
    t, heads, d, rot = 4, 5, 16, 12  # partial rotary: dims 12..15 untouched
    qkv = torch.randn(t, heads + 2, d, generator=gen).to(dtype)
    before = qkv.clone()
    x, x_ref = qkv[:, :heads], qkv.clone()[:, :heads]  # strided rows
    cs = torch.randn(t, 1, rot, generator=gen)
    cos, sin = cs[..., : rot // 2], cs[..., rot // 2 :]
    ops.rotary(x, cos, sin, rot, style)
    ops.rotary_ref(x_ref, cos, sin, rot, style)
    assert _rel_err(x, x_ref) < _tol(dtype)
    assert not torch.equal(x, before[:, :heads])  # it did rotate
    # the v rows beside are untouched (against a copy taken before the call)
    torch.testing.assert_close(qkv[:, heads:], before[:, heads:], rtol=0, atol=0)


@pytest.mark.parametrize("cos_shape,sin_shape,rot", [((4, 1, 6), (4, 1, 0), 12), ((3, 1, 6), (3, 1, 6), 12),
                                                      ((4, 1, 5), (4, 1, 5), 12), ((4, 1, 9), (4, 1, 9), 18),
                                                      ((4, 1, 6), (4, 1, 6), 11)])
def test_rotary_refuses_cos_sin_it_would_read_past(cos_shape, sin_shape, rot):
    """cos / sin other than [T, 1, rot_dim / 2] (or rot_dim odd or past the head) raise with the shapes
    named: the kernel would read past their end (a segfault, seen with a mis-built rotary table)."""
    x = torch.randn(4, 2, 16)
    cos, sin = torch.randn(cos_shape), torch.randn(sin_shape)
    with pytest.raises(ValueError) as err:
        ops.rotary(x, cos, sin, rot, "neox")
    assert str(err.value) == (f"rotary: cos and sin must be [4, 1, {rot // 2}] for x [4, 2, 16] and rot_dim {rot}, "
                              f"got {list(cos_shape)} and {list(sin_shape)}")


@pytest.mark.parametrize("dtype", FLOAT)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_new", "relu"])
def test_act_and_mul_matches_reference(dtype, act):
    fg = (torch.randn(3, 2 * 77, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    assert _rel_err(ops.act_and_mul(fg, act), ops.act_and_mul_ref(fg, act)) < _tol(dtype)


def test_off_switch_and_missing_compiler_fall_back(monkeypatch):
    monkeypatch.setenv(build.ENV_VAR, "off")
    assert not build.enabled()
    monkeypatch.setenv(build.ENV_VAR, "auto")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    build.library.cache_clear()
    build.built_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be built"):
            assert build.library() is None
    finally:
        monkeypatch.delenv("CC")
        build.library.cache_clear()
        build.built_library.cache_clear()
    assert build.library() is not None


@pytest.mark.parametrize("dtype", FLOAT)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("d,rot", [(64, 64), (80, 52), (128, 96)])
def test_rotary_vector_widths_match_reference(dtype, style, d, rot):
    """Head sizes where the vector paths run (whole vectors of a, b pairs) and leave tails."""
    gen = torch.Generator().manual_seed(d + rot)
    t, heads = 3, 4
    qkv = torch.randn(t, heads + 1, d, generator=gen).to(dtype)
    before = qkv.clone()
    x, x_ref = qkv[:, :heads], qkv.clone()[:, :heads]
    cs = torch.randn(t, 1, rot, generator=gen).to(dtype)  # bfloat16 cos / sin too
    cos, sin = cs[..., : rot // 2], cs[..., rot // 2 :]
    ops.rotary(x, cos, sin, rot, style)
    ops.rotary_ref(x_ref, cos, sin, rot, style)
    assert _rel_err(x, x_ref) < _tol(dtype)
    torch.testing.assert_close(qkv[..., rot:], before[..., rot:], rtol=0, atol=0)  # past rot: untouched
    torch.testing.assert_close(qkv[:, heads:], before[:, heads:], rtol=0, atol=0)


@pytest.mark.parametrize("pool", ["float32", "bfloat16", "int8", "fp8"])
def test_decode_attention_long_context_matches_reference(pool):
    """Hundreds of keys (the vector softmax), head_dim 64 (whole vectors), several sequences."""
    gen = torch.Generator().manual_seed(15)
    blocks, bs, kvh, d, h = 40, 16, 3, 64, 9
    k, v = torch.randn(blocks, bs, kvh, d, generator=gen) * 2, torch.randn(blocks, bs, kvh, d, generator=gen)
    scales = None
    if pool in ("int8", "fp8"):
        scales = torch.tensor([0.04, 0.01])
        code = torch.int8 if pool == "int8" else torch.float8_e4m3fn
        k_pool, v_pool = quantize_kv(k, scales[0], code), quantize_kv(v, scales[1], code)
    else:
        k_pool, v_pool = k.to(getattr(torch, pool)), v.to(getattr(torch, pool))
    tables = torch.randperm(blocks, generator=gen)[:36].reshape(2, 18)
    kv_lens = torch.tensor([283, 17])
    q = torch.randn(2, h, d, generator=gen)
    out = ops.decode_attention(q, k_pool, v_pool, tables, kv_lens, d**-0.5, kv_scales=scales)
    ref = ops.decode_attention_ref(q, k_pool, v_pool, tables, kv_lens, d**-0.5, kv_scales=scales)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", FLOAT)
def test_norm_activation_and_kv_write_at_model_widths(dtype):
    """Widths of real models (whole vectors, no tails): rms_norm, act_and_mul, kv_write codes."""
    gen = torch.Generator().manual_seed(16)
    x, w = torch.randn(2, 576, generator=gen).to(dtype), torch.randn(576, generator=gen).to(dtype)
    assert _rel_err(ops.rms_norm(x, w, 1e-5), ops.rms_norm_ref(x, w, 1e-5)) < _tol(dtype)
    fg = (torch.randn(2, 2 * 1536, generator=gen) * 4).to(dtype)
    for act in ("silu", "gelu", "gelu_new", "relu"):
        assert _rel_err(ops.act_and_mul(fg, act), ops.act_and_mul_ref(fg, act)) < _tol(dtype), act
    kv = (torch.randn(3, 2, 3, 64, generator=gen) * 30).to(dtype)
    slots, scales = torch.tensor([1, 9, 4]), torch.tensor([0.2, 0.05])
    for code in KV_CODE_DTYPES:
        pools = [torch.zeros(4, 4, 3, 64, dtype=code) for _ in range(2)]
        ops.kv_write(kv[:, 0], kv[:, 1], pools[0], pools[1], slots, scales)
        for i in range(2):
            want = quantize_kv(kv[:, i], scales[i], code)
            assert torch.equal(as_bytes(pools[i].flatten(0, 1)[slots]), as_bytes(want)), (code, i)


@pytest.mark.parametrize("v", [1, 7, 16, 100, 49152])
def test_argmax_rows_is_torch_argmax(v):
    """The greedy token: torch.argmax's answer on every build, for a maximum anywhere (the vector
    part or the tail past whole vectors), ties (the first), infinities, every entry -inf (0) and
    NaN (the first NaN), row by row in a batch."""
    gen = torch.Generator().manual_seed(v)
    x = torch.randn(9, v, generator=gen)
    x[1, -1] = 50.0  # the last entry (the tail when v is not a multiple of the vector width)
    x[2, :] = 3.0  # all tied: the first
    if v > 3:
        x[3, [1, v - 2]] = 9.0  # a tie across lanes / blocks: the first
        x[6, [v // 2, v - 1]] = float("nan")  # the first NaN
        x[7, 2] = float("inf")
    x[4, :] = float("-inf")
    x[5, v // 3] = float("nan")
    x[8, 0] = 7.0  # the first entry
    assert ops.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    assert ops.argmax_rows(x[5:6]).tolist() == [v // 3]
