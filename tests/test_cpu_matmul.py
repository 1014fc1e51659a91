"""CPU float matmuls over transposed weights (core.layers.cpu_matmul) equal F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from bestiary.core.layers import cpu_matmul
from bestiary.core.layers.linear import Linear


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8, 9, 40])
def test_matmul_t_equals_linear(dtype, tokens, native, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "native_half_gemm", lambda _dtype: native)
    monkeypatch.setattr(cpu_matmul, "UPCAST_CHUNK", 96 * 50)  # several column blocks
    g = torch.Generator().manual_seed(0)
    w = torch.randn(130, 96, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype)
    x = torch.randn(tokens, 96, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    y = cpu_matmul.matmul_t(x, w.t().contiguous(), b)
    assert y.dtype == dtype and y.shape == (tokens, 130)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_linear_holds_its_weight_transposed_without_a_copy():
    lin = Linear(96, 130, bias=True)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    before = lin.weight.detach().clone()
    x = torch.randn(5, 96)
    ref = F.linear(x, before, lin.bias)
    lin.fuse()
    assert lin._wt is not None and lin._wt.is_contiguous() and lin._wt.shape == (96, 130)
    assert lin.weight.shape == (130, 96) and torch.equal(lin.weight, before)  # same parameter, same values
    assert lin.weight.data_ptr() == lin._wt.data_ptr()
    torch.testing.assert_close(lin(x), ref)
    assert torch.equal(lin.state_dict()["weight"], before)


def test_column_major_slices_are_not_copied():
    fused_t = torch.randn(96, 260)  # [K, 2N]: a gated MLP's fused weight held transposed
    param = torch.nn.Parameter(fused_t.t()[:130], requires_grad=False)  # [N, K] view, column-major
    wt = cpu_matmul.hold_transposed(param)
    assert wt.data_ptr() == fused_t.data_ptr() and wt.shape == (96, 130)


def test_cpu_flags_decide_native_half(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni"}))
    assert not cpu_matmul.native_half_gemm(torch.bfloat16)
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert cpu_matmul.native_half_gemm(torch.bfloat16) and not cpu_matmul.native_half_gemm(torch.float16)
