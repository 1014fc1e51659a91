"""Rotary position embedding applied in place to packed heads x [T, n, D].

For token t at position p_t and pair i < rot_dim/2 (theta_i from core.layers.rotary):

    x'_a = x_a cos(p_t theta_i) - x_b sin(p_t theta_i)
    x'_b = x_b cos(p_t theta_i) + x_a sin(p_t theta_i)

with (a, b) = (i, i + rot_dim/2) in neox style (half split) and (2i, 2i + 1) in gptj
style (interleaved). Dims from rot_dim on are untouched (partial rotary, ChatGLM).

Two call shapes share one kernel:
- `apply_rotary(x, cos, sin, ...)`: cos/sin [T, 1, rot_dim/2] already gathered per token
  (what `Rotary.apply` receives);
- `rotary_embedding(x, positions, cos_sin, ...)`: positions [T] index a table
  cos_sin [P, rot_dim] = [cos | sin] in the kernel (packed batches, no gather).
x may be a strided view (q and k heads of a fused qkv) as long as its last stride is 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bestiary.core.format.errors import ConfigError

STYLES = ("neox", "gptj")

# --- torch references (the CPU path: the exact ops of core.layers.rotary.Rotary.apply) ----


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int, style: str) -> None:
    """Rotate x [T, n, D] in place with cos/sin [T, 1, rot_dim/2] (math in x's dtype)."""
    half = rot_dim // 2
    if style == "neox":
        a, b = x[..., :half], x[..., half:rot_dim]
    else:
        pairs = x[..., :rot_dim].unflatten(-1, (half, 2))
        a, b = pairs[..., 0], pairs[..., 1]
    a2 = a * cos - b * sin
    b2 = b * cos + a * sin
    a.copy_(a2)
    b.copy_(b2)


def rotary_embedding_ref(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rot_dim: int, style: str
) -> None:
    """Rotate x [T, n, D] in place at positions [T] from cos_sin [P, rot_dim] (gather, then apply_rotary_ref)."""
    cs = cos_sin.index_select(0, positions).to(x.dtype).unsqueeze(1)  # [T, 1, rot_dim]
    half = rot_dim // 2
    apply_rotary_ref(x, cs[..., :half], cs[..., half:], rot_dim, style)


# --- Triton kernel -------------------------------------------------------------------------


@triton.jit
def _rotary_kernel(
    x_ptr, stride_xt, stride_xh,
    cos_ptr, sin_ptr, stride_ct, stride_st,
    pos_ptr,
    n_heads, half,
    HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_R)
    if HAS_POS:
        row = tl.load(pos_ptr + t).to(tl.int64)
    else:
        row = t
    r_mask = i < half
    cos = tl.load(cos_ptr + row * stride_ct + i, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_st + i, mask=r_mask, other=0.0).to(tl.float32)
    if INTERLEAVED:
        ia = 2 * i
        ib = 2 * i + 1
    else:
        ia = i
        ib = i + half
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh  # [BLOCK_H, 1]
    mask = (heads[:, None] < n_heads) & r_mask[None, :]
    a = tl.load(base + ia[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_R]
    b = tl.load(base + ib[None, :], mask=mask, other=0.0).to(tl.float32)
    a2 = a * cos[None, :] - b * sin[None, :]
    b2 = b * cos[None, :] + a * sin[None, :]
    tl.store(base + ia[None, :], a2.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + ib[None, :], b2.to(x_ptr.dtype.element_ty), mask=mask)


# --- launchers -----------------------------------------------------------------------------


def _launch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None, rot_dim: int, style: str
) -> None:
    if style not in STYLES:
        raise ConfigError(f"rotary style {style!r}: expected neox or gptj")
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary kernel: x, cos and sin need a unit last stride")
    t, n_heads = x.shape[0], x.shape[1]
    half = rot_dim // 2
    block_h = min(triton.next_power_of_2(n_heads), 16)
    grid = (t, triton.cdiv(n_heads, block_h))
    _rotary_kernel[grid](
        x, x.stride(0), x.stride(1), cos, sin, cos.stride(0), sin.stride(0),
        positions if positions is not None else x, n_heads, half,
        HAS_POS=positions is not None, INTERLEAVED=style == "gptj",
        BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(half),
    )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int, style: str) -> None:
    """Triton: rotate x [T, n, D] in place with cos/sin [T, 1, rot_dim/2] (math in float32)."""
    _launch(x, cos, sin, None, rot_dim, style)


def rotary_embedding(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rot_dim: int, style: str
) -> None:
    """Triton: rotate x [T, n, D] in place at positions [T] read from cos_sin [P, rot_dim]."""
    half = rot_dim // 2
    _launch(x, cos_sin[:, :half], cos_sin[:, half:], positions, rot_dim, style)
