"""Weight-only GEMM: int8 per channel, int4 group-wise (64 / 128, with and without zeros)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DOT_DTYPES, assert_close, assert_far

from bestiary.core.kernels import dispatch

woq = dispatch.family("woq_gemm")


def _int4(n: int, k: int, group: int, zeros: bool, dtype: torch.dtype, device):
    codes = torch.randint(0, 16, (n, k))
    scales = (torch.rand(n, k // group) / 20 + 0.01).to(dtype).to(device)
    z = torch.randint(0, 16, (n, k // group)).to(dtype).to(device) if zeros else None
    return codes, woq.pack_int4(codes).to(device), scales, z


def test_pack_layout():
    """Byte j of a row holds code 2j in its low nibble and code 2j + 1 in its high nibble."""
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]])
    packed = woq.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x0F], [0x87, 0xC3]]
    assert torch.equal(woq.unpack_int4(packed), codes.to(torch.uint8))


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("m,k", [(3, 96), (5, 300), (17, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8(m, k, bias, dtype, device):
    n = 129
    x = torch.randn(m, k).to(dtype).to(device)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8).to(device)
    s = (torch.rand(n) / 100 + 1e-3).to(dtype).to(device)
    b = torch.randn(n).to(dtype).to(device) if bias else None
    ref = woq.woq_int8_linear_ref(x.float(), q, s.float(), None if b is None else b.float())  # float32 reference
    assert_close(woq.woq_int8_linear(x, q, s, b, block_k=32), ref, dtype)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("m", [3, 17])
def test_int4(m, group, zeros, dtype, device):
    """M 3 and 17 (a decode tile and a 64-row tile with one row), N 129 (a partial N tile)."""
    n, k = 129, 256
    x = torch.randn(m, k).to(dtype).to(device)
    _, qweight, scales, z = _int4(n, k, group, zeros, dtype, device)
    b = torch.randn(n).to(dtype).to(device)
    out = woq.woq_int4_linear(x, qweight, scales, z, group, b, block_k=32)
    assert_close(out, woq.woq_int4_linear_ref(x, qweight, scales, z, group, b), dtype)


def test_int4_dequantize_is_the_documented_formula():
    codes, qweight, scales, z = _int4(3, 128, 64, True, torch.float32, "cpu")
    w = woq.dequantize_int4(qweight, scales, z, 64, torch.float32)
    assert torch.equal(w[:, 70], (codes[:, 70].float() - z[:, 1]) * scales[:, 1])
    w_sym = woq.dequantize_int4(qweight, scales, None, 64, torch.float32)
    assert torch.equal(w_sym[:, 5], (codes[:, 5].float() - 8) * scales[:, 0])


def test_broken_variant_misses(device):
    """Nibbles swapped in the packed weight."""
    x = torch.randn(3, 128).to(device)
    _, qweight, scales, _ = _int4(129, 128, 64, False, torch.float32, device)
    swapped = (qweight >> 4) | (qweight << 4)
    out = woq.woq_int4_linear(x, swapped, scales, None, 64)
    assert_far(out, woq.woq_int4_linear_ref(x, qweight, scales, None, 64), torch.float32)


def test_dispatch_routes_both_formats(device):
    x = torch.randn(2, 3, 128).to(device)  # a leading batch dim: [..., K]
    q8 = torch.randint(-128, 128, (40, 128), dtype=torch.int8).to(device)
    s8 = (torch.rand(40) / 100).to(device)
    _, q4, s4, z4 = _int4(40, 128, 64, True, torch.float32, device)
    for run in (lambda: dispatch.woq_int8_linear(x, q8, s8), lambda: dispatch.woq_int4_linear(x, q4, s4, z4, 64)):
        with dispatch.kernels_mode("triton"):
            out = run()
        with dispatch.kernels_mode("torch"):
            ref = run()
        assert out.shape == (2, 3, 40)
        assert_close(out, ref, torch.float32)
