"""RMSNorm and LayerNorm over the last dim, alone or fused with the residual add.

For a row x [H] with weight w and optional bias b (statistics in float32):

    rms_norm:    y = x / sqrt(mean(x^2) + eps) * w
    layer_norm:  y = (x - mean(x)) / sqrt(var(x) + eps) * w + b      (biased variance)
    add_*_norm:  h = x + residual (rounded to x's dtype);  y = norm(h);  returns (y, h)

y is returned in x's dtype. One Triton program normalises one row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# --- torch references (the CPU path: the exact ops of core.layers.norm) --------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> [..., H]: F.rms_norm (its CPU kernel computes half inputs in float32 and
    rounds once); elsewhere, for half types, the float32 math written out and cast back."""
    if x.dtype == torch.float32 or (x.device.type == "cpu" and x.dtype == weight.dtype):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., H] -> [..., H]: F.layer_norm in float32, cast back to x's dtype."""
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


def add_layer_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual)."""
    h = x + residual
    return layer_norm_ref(h, weight, bias, eps), h


# --- Triton kernel -------------------------------------------------------------------------


@triton.jit
def _norm_kernel(
    x_ptr, stride_x,
    res_ptr, stride_res,
    h_ptr, stride_h,
    y_ptr, stride_y,
    w_ptr, b_ptr,
    n_cols, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)  # rounded like torch's x + r
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
        x = h
    x = x.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# --- launchers -----------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., H] as a 2-D [rows, H] view (copy only if it has no unit last stride)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
    eps: float, is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (+ residual) -> (y, h) [..., H]: the norm of h = x + residual (without a residual, h is y)."""
    n = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    h = torch.empty_like(y) if residual is not None else y
    block = triton.next_power_of_2(n)
    _norm_kernel[(x2.shape[0],)](
        x2, x2.stride(0), res2, res2.stride(0), h, h.stride(0), y, y.stride(0),
        weight, bias if bias is not None else weight, n, eps,
        IS_RMS=is_rms, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return y.view(x.shape), h.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton rms_norm: x [..., H] -> [..., H]."""
    return _launch(x, None, weight, None, eps, True)[0]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Triton layer_norm (bias optional): x [..., H] -> [..., H]."""
    return _launch(x, None, weight, bias, eps, False)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fused residual add + rms_norm: (y, h), both [..., H]."""
    return _launch(x, residual, weight, None, eps, True)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fused residual add + layer_norm: (y, h), both [..., H]."""
    return _launch(x, residual, weight, bias, eps, False)
