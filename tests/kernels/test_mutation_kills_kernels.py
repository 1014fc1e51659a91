"""Kernel-family contracts that `make mutation` (tests/mutation_run.py kernels) found untested.

Here, not in tests/, because the kernel modules must be imported under this folder's conftest
(TRITON_INTERPRET=1). Each test names the mutants of core/kernels/ it kills; the references
are the math written out in the test, not the module's own `_ref` functions.
"""

from __future__ import annotations

import pytest
import torch
from bestiary.core.kernels import dispatch

norms = dispatch.family("norms")
woq = dispatch.family("woq_gemm")
moe = dispatch.family("moe")
sampling = dispatch.family("sampling")


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_rms_norm_ref_is_the_formula(x_dtype, w_dtype) -> None:
    """rms_norm_ref(x, w, eps) = x / sqrt(mean(x^2) + eps) * w in float32, cast to x's dtype, for
    each branch: F.rms_norm (float32; half x with a weight of its dtype) and the written-out
    float32 math (half x, float32 weight), which no CPU test reached (rms_norm_ref 18-33). Rows
    of mean(x^2) ~ 0.04, 1 and 9 next to eps = 0.5: a dropped eps (11, 15), x^3 (28) or a mean
    over the wrong dims (23, 30) shows."""
    torch.manual_seed(0)
    x = (torch.randn(3, 40) * torch.tensor([[0.2], [1.0], [3.0]])).to(x_dtype)
    w = (torch.rand(40) + 0.5).to(w_dtype)
    xf = x.float()
    want = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 0.5) * w.float()).to(x_dtype)
    got = norms.rms_norm_ref(x, w, 0.5)
    assert got.dtype == x_dtype
    tol = 1e-6 if x_dtype == torch.float32 else 1e-2  # bf16: one rounding of a value < 2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("bias", [False, True])
def test_layer_norm_ref_is_the_formula(bias) -> None:
    """layer_norm_ref = (x - mean) / sqrt(var + eps) * w + b in float32, cast back; eps = 0.5 and a
    bf16 input (the float32 promotion matters)."""
    torch.manual_seed(1)
    x = (torch.randn(4, 24) / 10 + 0.3).to(torch.bfloat16)
    w, b = torch.rand(24) + 0.5, (torch.randn(24) if bias else None)
    xf = x.float()
    mean, var = xf.mean(-1, keepdim=True), xf.var(-1, unbiased=False, keepdim=True)
    want = (xf - mean) / torch.sqrt(var + 0.5) * w + (b if bias else 0.0)
    got = norms.layer_norm_ref(x, w.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16), 0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_woq_int8_ref_in_bf16() -> None:
    """woq_int8_linear_ref with bf16 x and float32 scales: x (q s)^T (+ b) to bf16 accuracy
    (woq_int8_linear_ref 20: the scales left in float32 for aten's bf16 int8 matmul)."""
    torch.manual_seed(2)
    x = torch.randn(5, 64).to(torch.bfloat16)
    q = torch.randint(-128, 128, (33, 64), dtype=torch.int8)
    s = torch.rand(33) / 100 + 1e-3
    want = x.float() @ (q.float() * s[:, None]).t()
    got = woq.woq_int8_linear_ref(x, q, s)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def strided(t: torch.Tensor, how: str) -> torch.Tensor:
    """The values of t [R, C] in a non-contiguous layout: 'step' has stride(-1) == 2, 'transposed'
    stride(-2) == 1."""
    if how == "step":
        wide = t.new_zeros(t.shape[0], 2 * t.shape[1])
        wide[:, ::2] = t
        return wide[:, ::2]
    return t.t().contiguous().t()


@pytest.mark.parametrize("how", ["step", "transposed"])
def test_launchers_take_non_contiguous_inputs(how, device) -> None:
    """Launchers on inputs whose last dim is not contiguous equal their results on contiguous
    copies: moe_route 5, 8-10, woq_int8_linear 13, 16-18, woq_int4_linear 28, 31-33, the norms'
    _rows 11, 14-16, sampling's filter_logits 3, 6-8 (the kernel then reads a strided tensor as
    if it were dense)."""
    torch.manual_seed(3)
    logits = torch.randn(6, 8, device=device)
    w_ref, e_ref = moe.moe_route(logits, 2)
    w, e = moe.moe_route(strided(logits, how), 2)
    assert torch.equal(e, e_ref)
    torch.testing.assert_close(w, w_ref)
    x = torch.randn(4, 64, device=device)
    q = torch.randint(-128, 128, (32, 64), dtype=torch.int8, device=device)
    s = torch.rand(32, device=device) / 100 + 1e-3
    want = woq.woq_int8_linear(x, q, s, None, block_k=32)
    got = woq.woq_int8_linear(strided(x, how), q, s, None, block_k=32)
    torch.testing.assert_close(got, want)
    q4 = woq.pack_int4(torch.randint(0, 16, (32, 64))).to(device)  # [N, K / 2], one group of 64
    s4 = torch.rand(32, 1, device=device) / 20 + 0.01
    want = woq.woq_int4_linear(x, q4, s4, None, 64, block_k=32)
    torch.testing.assert_close(woq.woq_int4_linear(strided(x, how), q4, s4, None, 64, block_k=32), want)
    w = torch.rand(64, device=device) + 0.5
    torch.testing.assert_close(norms.rms_norm(strided(x, how), w, 1e-5), norms.rms_norm(x, w, 1e-5))
    top_k = torch.tensor([3, 0, 0, 5], device=device)
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.9], device=device)
    want = sampling.filter_logits(x, top_k, top_p)
    assert torch.equal(sampling.filter_logits(strided(x, how), top_k, top_p), want)
