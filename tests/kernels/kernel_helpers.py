"""Tolerances of the kernel tests (imported as `kernel_helpers`; tests/kernels is on sys.path).

A kernel output passes when max|out - ref| <= TOL[dtype] * max(1, max|ref|). The bounds
cover one rounding of the output plus accumulation-order differences: bf16 allows two
ulps (the interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest), fp16
two ulps, fp32 ~100 ulps of reordered sums. A "broken" variant must miss by MISS x that.
"""

from __future__ import annotations

import os

import pytest
import torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
MISS = 100.0
ON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

# tl.dot on bfloat16 is wrong under the interpreter (triton issue 11584): the dot kernels
# are checked in bf16 on a GPU only.
DOT_DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(ON_INTERPRETER, reason="interpreter: bf16 tl.dot")),
]
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bound(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """The pass bound for `ref` computed in `dtype`."""
    return TOL[dtype] * max(1.0, ref.float().abs().max().item())


def diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in float32 (shapes must match)."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    return (out.float().cpu() - ref.float().cpu()).abs().max().item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """out matches ref within the dtype's tolerance."""
    d, b = diff(out, ref), bound(ref, dtype)
    assert d <= b, f"{dtype}: max |out - ref| = {d:.3g} > bound {b:.3g}"


def assert_far(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """A deliberately broken variant misses ref by at least MISS x the bound."""
    d, b = diff(out, ref), bound(ref, dtype)
    assert d >= MISS * b, f"{dtype}: broken variant only {d:.3g} away (< {MISS:g} x {b:.3g}): the test cannot fail"
