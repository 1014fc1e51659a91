"""Weight-only quantized GEMM: int8 per output channel and int4 group-wise.

Activations x [..., K] in float16 / bfloat16 / float32; the output has x's dtype.
Weights keep the checkpoint's (out_features N, in_features K) orientation.

int8 per channel (W8A16):
    qweight int8 [N, K];  scales [N] (any float dtype)
    y[m, n] = (sum_k x[m, k] q[n, k]) * s[n] + b[n]
  The layout of torch.ops.aten._weight_int8pack_mm, the CPU reference.

int4 group-wise (W4A16, group_size G in {64, 128}, K % G == 0):
    qweight uint8 [N, K / 2], two 4-bit codes per byte, low nibble first:
        qweight[n, j] = q[n, 2j] | (q[n, 2j + 1] << 4),   q in 0..15
    scales [N, K / G] (any float dtype);  zeros [N, K / G] (same dtype) or None
    w[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]     (zeros None: z = 8, symmetric)
    y = x @ w^T + b
  Zero points are stored as floats in the code domain (an integer 0..15 for AWQ/GPTQ
  asymmetric weights). `pack_int4` / `unpack_int4` convert codes [N, K] <-> qweight.

The kernels dequantize a [BLOCK_N, BLOCK_K] weight tile to x's dtype in registers and
accumulate x @ w^T in float32; the torch references dequantize the whole matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bestiary.core.format.errors import ConfigError
from bestiary.core.kernels.attention import dot_precision

GROUP_SIZES = (64, 128)

# --- layout helpers ------------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] integers in 0..15 -> qweight uint8 [N, K/2], low nibble = even k."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight uint8 [N, K/2] -> codes uint8 [N, K] (inverse of pack_int4)."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).flatten(-2)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """w [N, K] = (q - z) * s per group, computed in float32 and rounded to `dtype`."""
    q = unpack_int4(qweight).float()  # [N, K]
    s = scales.float().repeat_interleave(group_size, dim=1)  # [N, K]
    z = zeros.float().repeat_interleave(group_size, dim=1) if zeros is not None else 8.0
    return ((q - z) * s).to(dtype)


def _check_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    k = x.shape[-1]
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"group_size {group_size}: expected one of {GROUP_SIZES}")
    if k % group_size or qweight.shape[1] * 2 != k or scales.shape != (qweight.shape[0], k // group_size):
        raise ValueError(
            f"int4 GEMM: x [.., {k}], qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)} "
            f"do not fit K={k}, group_size={group_size}"
        )


# --- torch references ----------------------------------------------------------------------


def woq_int8_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] -> [..., N]: aten's int8 weight-pack matmul on CPU, else dequantize + F.linear."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu":
        y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), qweight, scales.to(x.dtype))
    else:
        y = F.linear(x2, qweight.to(x.dtype)) * scales.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], -1)


def woq_int4_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] = F.linear(x, dequantize_int4(...), bias)."""
    _check_int4(x, qweight, scales, group_size)
    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, x.dtype), bias)


# --- Triton kernels ------------------------------------------------------------------------


@triton.jit
def _int8_kernel(
    x_ptr, stride_xm, q_ptr, stride_qn, s_ptr, b_ptr, y_ptr, stride_ym,
    M, N, K,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        q = tl.load(q_ptr + offs_n[None, :].to(tl.int64) * stride_qn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0)  # [BLOCK_K, BLOCK_N] = q^T tile
        acc += tl.dot(x, q.to(x.dtype), input_precision=DOT_PREC)
    y = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_kernel(
    x_ptr, stride_xm, q_ptr, stride_qn, s_ptr, z_ptr, stride_sn, b_ptr, y_ptr, stride_ym,
    M, N, K, group_size,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_b = tl.arange(0, BLOCK_K // 2)  # bytes of one K tile
    row_q = q_ptr + offs_n[:, None].to(tl.int64) * stride_qn  # [BLOCK_N, 1]
    row_s = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides group_size: one group per tile
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None], other=0.0)
        packed = tl.load(row_q + k0 // 2 + offs_b[None, :], mask=n_mask[:, None], other=0)  # [BLOCK_N, BLOCK_K/2]
        codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K], k = 2j, 2j+1
        g = k0 // group_size
        s = tl.load(s_ptr + row_s + g, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + row_s + g, mask=n_mask, other=0.0).to(tl.float32)
        else:
            z = tl.full([BLOCK_N], 8.0, tl.float32)
        w = ((codes - z[:, None]) * s[:, None]).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# --- launchers -----------------------------------------------------------------------------


def _tiles(m: int, n: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): small M (decode) gets the minimum tl.dot height."""
    return (16 if m <= 16 else 64), (32 if n <= 32 else 64)


def woq_int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
    block_k: int = 64,
) -> torch.Tensor:
    """Triton int8 weight-only GEMM: x [..., K] -> [..., N]."""
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn = _tiles(m, n)
    _int8_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x2, x2.stride(0), qweight, qweight.stride(0), scales, bias if bias is not None else scales, y, y.stride(0),
        m, n, k, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k,
        DOT_PREC=dot_precision(x.dtype),
    )
    return y.view(*x.shape[:-1], n)


def woq_int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    group_size: int, bias: torch.Tensor | None = None, block_k: int = 64,
) -> torch.Tensor:
    """Triton int4 group-wise weight-only GEMM: x [..., K] -> [..., N]."""
    _check_int4(x, qweight, scales, group_size)
    if group_size % block_k:
        raise ValueError(f"int4 GEMM: block_k {block_k} must divide group_size {group_size}")
    if zeros is not None and zeros.stride() != scales.stride():
        zeros = zeros.contiguous()
        scales = scales.contiguous()
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn = _tiles(m, n)
    _int4_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x2, x2.stride(0), qweight, qweight.stride(0), scales, zeros if zeros is not None else scales,
        scales.stride(0), bias if bias is not None else scales, y, y.stride(0),
        m, n, k, group_size,
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k,
        DOT_PREC=dot_precision(x.dtype),
    )
    return y.view(*x.shape[:-1], n)
