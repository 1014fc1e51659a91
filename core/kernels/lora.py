"""Batched LoRA: a different adapter (and rank) per sequence of a packed batch (SGMV / BGMV).

The packed tokens x [T, K] are cut into segments (one per sequence): segment s covers rows
seg_starts[s] .. seg_starts[s+1] - 1 and uses adapter a = seg_adapters[s] (-1: none).
Adapters are stacked and zero-padded to the largest rank R:

    lora_a [L, R, K]   (A_a: the first ranks[a] rows are meaningful)
    lora_b [L, N, R]   (B_a: the first ranks[a] columns are meaningful)
    ranks [L] int, scalings [L] float (alpha / r)

    delta[t] = scalings[a] * B_a[:, :r_a] (A_a[:r_a] x[t])   for t in segment s, a >= 0
    delta[t] = 0                                            for a = -1

Decode steps are the BGMV case (every segment one token). The Triton path runs two
kernels, "shrink" v = x A^T [T, R] and "expand" delta = s v B^T, each one program per
(segment, BLOCK_M rows[, BLOCK_N outputs]); v is rounded to x's dtype between them as
in the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bestiary.core.kernels.attention import dot_precision

# --- torch reference -----------------------------------------------------------------------


def lora_sgmv_ref(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
    seg_adapters: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor,
) -> torch.Tensor:
    """delta [T, N] for x [T, K], looping over the segments."""
    out = torch.zeros(x.shape[0], lora_b.shape[1], dtype=x.dtype, device=x.device)
    starts = seg_starts.tolist()
    for s, a in enumerate(seg_adapters.tolist()):
        if a < 0:
            continue
        r = int(ranks[a])
        xs = x[starts[s] : starts[s + 1]]  # [n, K]
        v = xs @ lora_a[a, :r].t()  # [n, r]
        out[starts[s] : starts[s + 1]] = (v @ lora_b[a, :, :r].t()) * float(scalings[a])
    return out


# --- Triton kernels ------------------------------------------------------------------------


@triton.jit
def _shrink_kernel(
    x_ptr, stride_xt, a_ptr, stride_al, stride_ar, v_ptr, stride_vt,
    seg_start_ptr, seg_adapter_ptr, rank_ptr, K,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    s = tl.program_id(0)
    adapter = tl.load(seg_adapter_ptr + s).to(tl.int64)
    start = tl.load(seg_start_ptr + s)
    end = tl.load(seg_start_ptr + s + 1)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if (adapter < 0) | (start + tl.program_id(1) * BLOCK_M >= end):
        return
    m_mask = offs_m < end
    rank = tl.load(rank_ptr + adapter)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + adapter * stride_al + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_R] = A^T tile
        acc += tl.dot(x, a.to(x.dtype), input_precision=DOT_PREC)
    tl.store(v_ptr + offs_m[:, None].to(tl.int64) * stride_vt + offs_r[None, :], acc.to(v_ptr.dtype.element_ty),
             mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    v_ptr, stride_vt, b_ptr, stride_bl, stride_bn, y_ptr, stride_yt,
    seg_start_ptr, seg_adapter_ptr, rank_ptr, scaling_ptr, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr,
):
    s = tl.program_id(0)
    adapter = tl.load(seg_adapter_ptr + s).to(tl.int64)
    start = tl.load(seg_start_ptr + s)
    end = tl.load(seg_start_ptr + s + 1)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if (adapter < 0) | (start + tl.program_id(1) * BLOCK_M >= end):
        return
    m_mask = offs_m < end
    rank = tl.load(rank_ptr + adapter)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    v = tl.load(v_ptr + offs_m[:, None].to(tl.int64) * stride_vt + offs_r[None, :],
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
    b = tl.load(b_ptr + adapter * stride_bl + offs_n[None, :].to(tl.int64) * stride_bn + offs_r[:, None],
                mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N] = B^T tile
    y = tl.dot(v, b.to(v.dtype), input_precision=DOT_PREC) * tl.load(scaling_ptr + adapter).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_yt + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# --- launcher ------------------------------------------------------------------------------


def lora_sgmv(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor,
    seg_adapters: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor,
    block_m: int = 16, block_n: int = 64, block_k: int = 64, max_seg_len: int | None = None,
) -> torch.Tensor:
    """Triton SGMV: delta [T, N] for x [T, K] (shapes in the module docstring).

    max_seg_len bounds the rows of a segment (the grid); without it it is read from seg_starts.
    """
    x, lora_a, lora_b = (u if u.stride(-1) == 1 else u.contiguous() for u in (x, lora_a, lora_b))
    t, k = x.shape
    n, r_max = lora_b.shape[1], lora_a.shape[1]
    n_seg = seg_adapters.numel()
    if max_seg_len is None:
        max_seg_len = int((seg_starts[1:] - seg_starts[:-1]).max()) if n_seg else 0
    block_r = max(16, triton.next_power_of_2(r_max))
    v = torch.empty(t, block_r, dtype=x.dtype, device=x.device)
    y = torch.zeros(t, n, dtype=x.dtype, device=x.device)
    if n_seg == 0 or max_seg_len == 0:
        return y
    m_tiles = triton.cdiv(max_seg_len, block_m)
    prec = dot_precision(x.dtype)
    _shrink_kernel[(n_seg, m_tiles)](
        x, x.stride(0), lora_a, lora_a.stride(0), lora_a.stride(1), v, v.stride(0),
        seg_starts, seg_adapters, ranks, k,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, DOT_PREC=prec,
    )
    _expand_kernel[(n_seg, m_tiles, triton.cdiv(n, block_n))](
        v, v.stride(0), lora_b, lora_b.stride(0), lora_b.stride(1), y, y.stride(0),
        seg_starts, seg_adapters, ranks, scalings, n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, DOT_PREC=prec,
    )
    return y
