"""How float matmuls run on the CPU: weights held transposed, half precision by hardware.

A Linear's weight W is [N, K] (out, in). On the CPU, `hold_transposed` keeps the same
parameter (shape, values, state_dict) as a view of a contiguous W^T [K, N], and
`matmul_t(x, W^T)` computes y = x W^T [T, N]. Measured here (torch 2.13, one core):

    batch-1 GEMV, SmolLM2 shapes     x @ W^T reads ~23 GB/s in bf16 where F.linear(x, W)
                                     reads ~14; fp32 equal at T = 1, 1.6x faster at T = 16
    bf16 GEMM, T >= 16, a CPU        ~30 GFLOP/s: upcasting to fp32 and running the fp32
    without avx512_bf16 / AMX        GEMM is 2-3x faster despite the conversion

so half-precision inputs with more than HALF_GEMV_MAX_TOKENS rows run in fp32 (rounded back
to the input dtype once) unless the CPU has native bf16/fp16 dot products, where the
half-precision GEMM (oneDNN, AMX) is the fast one.
"""

from __future__ import annotations

import torch
from bestiary.core.cpu.build import cpu_flags
from bestiary.core.kernels import dispatch
from torch import nn

HALF_GEMV_MAX_TOKENS = 8
KERNEL_MAX_TOKENS = 32  # rows up to which bf16 matmuls run the compiled GEMV (no per-step fp32 upcast)
UPCAST_CHUNK = 1 << 22  # weight elements converted at a time (16 MiB of fp32)
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def native_half_gemm(dtype: torch.dtype) -> bool:
    """True if this CPU multiplies `dtype` (bf16/fp16) natively, or if we cannot tell."""
    flags = cpu_flags()
    return not flags or any(f in flags for f in NATIVE_FLAGS.get(dtype, ()))


def hold_transposed(param: nn.Parameter) -> torch.Tensor:
    """Make `param` ([N, K]) a view of a contiguous [K, N] tensor; returns that [K, N] tensor.

    A weight already held column-major (a slice of a fused transposed weight) is not copied."""
    if param.dim() == 2 and param.stride(0) == 1 and param.shape[0] > 1:
        return param.data.t()  # [K, N] view, rows possibly strided
    transposed = param.data.t().contiguous()  # [K, N]
    param.data = transposed.t()
    return transposed


def upcast_matmul(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ wt [K, N] computed in fp32, a block of columns at a time -> [T, N] fp32."""
    k, n = wt.shape
    step = max(1, UPCAST_CHUNK // k)
    xf = x.float()
    if step >= n:
        return xf @ wt.float()
    return torch.cat([xf @ wt[:, j : j + step].float() for j in range(0, n, step)], dim=1)


def matmul_t(x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ wt + b: x [T, K], wt [K, N] (a CPU weight held transposed) -> [T, N] in x's dtype.

    bfloat16 weights at <= KERNEL_MAX_TOKENS rows run the compiled GEMV (core.cpu), which
    reads them ~2x faster than torch's bf16 GEMV here; float32 ones stay with torch (MKL)."""
    x2 = x.reshape(-1, x.shape[-1])
    if (wt.dtype == torch.bfloat16 and x2.dtype == wt.dtype and x2.shape[0] <= KERNEL_MAX_TOKENS
            and wt.is_contiguous() and dispatch.use_cpu_kernels(x2, wt)):
        y = dispatch.cpu_ops().linear_t(x2, wt)
    elif x2.dtype in NATIVE_FLAGS and x2.shape[0] > HALF_GEMV_MAX_TOKENS and not native_half_gemm(x2.dtype):
        y = upcast_matmul(x2, wt)  # float32
    else:
        y = x2 @ wt
    if bias is not None:
        y += bias
    y = y.to(x.dtype)  # rounds the upcast GEMM's float32 once (bias included); no-op otherwise
    return y.view(*x.shape[:-1], wt.shape[1])


def dense_weight_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x W^T for a weight W [N, K] made on the fly (dequantized): fp32 GEMM for half
    inputs on CPUs without native half dot products, else x's dtype. -> [T, N] in x's dtype."""
    if x.dtype in NATIVE_FLAGS and not native_half_gemm(x.dtype):
        return torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)
    return torch.nn.functional.linear(x, w.to(x.dtype))
