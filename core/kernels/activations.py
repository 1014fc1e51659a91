"""Activations, plain and fused with the gate of a gated MLP.

    act_and_mul(f, g) = act(f) * g          (SwiGLU: act = silu; GeGLU: act = gelu)
    activation(x)     = act(x)

    silu(x)      = x * sigmoid(x)                                   (names: silu, swiglu)
    gelu(x)      = x/2 * (1 + erf(x / sqrt(2)))                      (gelu)
    gelu_tanh(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))  (gelu_new, gelu_pytorch_tanh)
    relu(x)      = max(x, 0)                                        (relu)

The kernel computes in float32 and rounds once to the output dtype. f and g may be
strided views (the two halves of a fused [T, 2I] matmul) with a unit last stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bestiary.core.format.errors import ConfigError
from bestiary.core.kernels.activations_ref import ACT_CODES, act_and_mul_ref, activation_ref  # noqa: F401 (references)

# --- Triton kernel -------------------------------------------------------------------------


@triton.jit
def _act(x, ACT: tl.constexpr):
    """act(x) for float32 x, ACT as in ACT_CODES."""
    if ACT == 0:
        e = tl.exp(-tl.abs(x))  # in (0, 1]: no overflow in either tail
        y = x * tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    elif ACT == 1:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = tl.exp(-2.0 * tl.abs(u))
        tanh = (1.0 - e) / (1.0 + e)
        y = 0.5 * x * (1.0 + tl.where(u >= 0, tanh, -tanh))
    else:
        y = tl.maximum(x, 0.0)
    return y


@triton.jit
def _act_and_mul_kernel(
    f_ptr, stride_f, g_ptr, stride_g, y_ptr, stride_y, n_cols,
    ACT: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    f = tl.load(f_ptr + row * stride_f + cols, mask=mask, other=0.0).to(tl.float32)
    y = _act(f, ACT)
    if HAS_GATE:
        y = y * tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# --- launchers -----------------------------------------------------------------------------


def _code(act: str) -> int:
    try:
        return ACT_CODES[act]
    except KeyError:
        raise ConfigError(f"hidden_act {act!r} has no Triton kernel; expected one of {sorted(ACT_CODES)}") from None


def _launch(f: torch.Tensor, g: torch.Tensor | None, act: str) -> torch.Tensor:
    n = f.shape[-1]
    f2 = f.reshape(-1, n)
    g2 = g.reshape(-1, n) if g is not None else f2
    if f2.stride(-1) != 1 or g2.stride(-1) != 1:
        raise ValueError("activation kernel: inputs need a unit last stride")
    y = torch.empty(f2.shape, dtype=f.dtype, device=f.device)
    block = min(triton.next_power_of_2(n), 1024)
    grid = (f2.shape[0], triton.cdiv(n, block))
    _act_and_mul_kernel[grid](
        f2, f2.stride(0), g2, g2.stride(0), y, y.stride(0), n,
        ACT=_code(act), HAS_GATE=g is not None, BLOCK=block,
    )
    return y.view(f.shape)


def act_and_mul(f: torch.Tensor, g: torch.Tensor, act: str) -> torch.Tensor:
    """Triton act(f) * g: f, g [..., I] -> [..., I] in f's dtype."""
    return _launch(f, g, act)


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """Triton act(x): [..., I] -> [..., I]."""
    return _launch(x, None, act)
