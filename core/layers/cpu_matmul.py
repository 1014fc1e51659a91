"""How float matmuls run on the CPU: weights held in row tiles or transposed, half precision by hardware.

A Linear's weight W is [N, K] (out, in). On the CPU:

- bfloat16 / float32 weights with N % 8 == 0 and K % 32 / 16 == 0, where the compiled kernels are
  built: `hold_tiled` repacks the parameter in place into row tiles (core.format.packing.pack_float_tiled:
  per 8 rows, per 64 bytes of features, the rows' blocks in turn), which the compiled GEMV reads as one
  sequential stream per tile: cache-cold, 2 threads, 29-37 GB/s against 22-24 for W^T (SmolLM2
  shapes, benchmarks/gemv_stream.py). `matmul_tiled(x, tiles)` runs it for every row count: each
  output row y[i, n] is summed in one order fixed by K alone (per lane in k order, then the lanes'
  tree), whatever the step's other rows, so a row's result does not depend on the batch, on chunking
  or on prefix reuse (batch invariance, docs/runtime.md); up to issue 54 steps past
  TILED_KERNEL_MAX_TOKENS rows ran torch's GEMM (oneDNN), which sums in another order, and the
  kernel measured as fast or faster there (benchmarks/tiled_crossover.py at 256 / 512 rows). Without
  the compiled kernels a block of rows at a time is put back in order into a scratch tensor for
  torch's GEMM (`untiled_rows`). The parameter keeps its shape, the
  module's state_dict its values (`untile_state_dict`), and an embedding that shares it looks
  its rows up in the tiles (`tiled_rows`).
- other float weights: `hold_transposed` keeps the same parameter (shape, values, state_dict)
  as a view of a contiguous W^T [K, N], and `matmul_t(x, W^T)` computes y = x W^T [T, N].

Measured here (torch 2.13, one core):

    batch-1 GEMV, SmolLM2 shapes     x @ W^T reads ~23 GB/s in bf16 where F.linear(x, W)
                                     reads ~14; fp32 equal at T = 1, 1.6x faster at T = 16
    bf16 GEMM, T >= 16, a CPU        ~30 GFLOP/s: upcasting to fp32 and running the fp32
    without avx512_bf16 / AMX        GEMM is 2-3x faster despite the conversion

so half-precision inputs with more than HALF_GEMV_MAX_TOKENS rows run in fp32 (rounded back
to the input dtype once) unless the CPU has native bf16/fp16 dot products, where the
half-precision GEMM (oneDNN, AMX) is the fast one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from bestiary.core.format import packing
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.cpu.build import cpu_flags, isa_name, library

HALF_GEMV_MAX_TOKENS = 8
KERNEL_MAX_TOKENS = 32  # rows up to which bf16 transposed matmuls run the compiled GEMV
# rows up to which weights in row tiles ran the compiled kernel before issue 54 (batch invariance: it now
# runs every row count; benchmarks/determinism.py --cost times these bounds against it), by the kernels'
# ISA: it reads the tiles as they lie, where torch's GEMM needs them put back in order first. torch / kernel time
# over 16 weights of each SmolLM2 shape in turn, 2 threads, one AVX-512 BF16 machine with each
# build forced, torch in fp32 for bf16 on the builds without native bf16 (benchmarks/tiled_crossover.py):
#   avx512bf16  bf16 1.13-1.31 at 128 rows, 0.98-1.18 at 256;  fp32 1.07-1.99 at 64, 0.90-1.47 at 128
#   avx512      bf16 1.09-1.37 at 256;                         fp32 1.20-1.63 at 128, 0.90-1.19 at 256
#   avx2        bf16 1.08-1.51 at 128, 0.76-1.11 at 256;       fp32 1.07-1.89 at 64, 0.82-1.40 at 128
TILED_KERNEL_MAX_TOKENS = {
    "avx512bf16": {torch.bfloat16: 128, torch.float32: 64},
    "avx512": {torch.bfloat16: 256, torch.float32: 128},
    "avx2": {torch.bfloat16: 128, torch.float32: 64},
}  # others: KERNEL_MAX_TOKENS

UPCAST_CHUNK = 1 << 22  # weight elements converted at a time (16 MiB of fp32)
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def tiled_kernel_max_tokens(dtype: torch.dtype) -> int:
    """Rows of `dtype` up to which matmul_tiled ran the compiled kernel on this build before issue 54
    (torch's GEMM above); matmul_tiled now runs it for any number of rows (`tiled_torch_from`)."""
    return TILED_KERNEL_MAX_TOKENS.get(isa_name(library()), {}).get(dtype, KERNEL_MAX_TOKENS)


def tiled_torch_from(dtype: torch.dtype) -> int | None:
    """Rows of `dtype` from which matmul_tiled runs torch's GEMM where the compiled kernels run: None,
    never (one reduction order per row whatever the step's rows). benchmarks/determinism.py --cost
    patches it to time tiled_kernel_max_tokens(dtype) + 1, the bound before issue 54."""
    return None


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


def tiles_fit(weight: torch.Tensor) -> bool:
    """True when this CPU float weight [N, K] is to be held in row tiles: bfloat16 with N % 8 == 0
    and K % 32 == 0, or float32 with K % 16 == 0, and the compiled kernels run here (they read
    the tiles; torch would not)."""
    return (weight.dim() == 2 and packing.float_tiles_fit(weight.shape[0], weight.shape[1], weight.dtype)
            and dispatch.use_cpu_kernels(weight))


def hold_tiled(module: nn.Module, name: str = "weight", tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Repack `module`'s parameter `name` ([N, K], tiles_fit) into row tiles in place, or
    make it `tiles` (its values already in row tiles); returns the tiles [N, K]. The module's
    state_dict keeps giving the values in order."""
    param = getattr(module, name)
    if tiles is None:  # in place inside a load's repack_in_place(): the load holds the weight once
        data = param.data
        param.data = packing.pack_float_tiled(data, in_place=may_repack_in_place(data))
    else:
        param.data = tiles
    tiled: set[str] | None = module.__dict__.get("_tiled_params")  # the names held in tiles
    if tiled is None:
        tiled = module.__dict__["_tiled_params"] = set()
        module._register_state_dict_hook(untile_state_dict)
    tiled.add(name)
    return param.data


_in_place = threading.local()  # .on: hold_tiled may repack a parameter's own memory (repack_in_place)


@contextlib.contextmanager
def repack_in_place() -> Iterator[None]:
    """Within this block hold_tiled repacks a parameter that owns its memory in place, not into a copy.
    Only for tensors nothing else can see: an engine load's reads from its file (Engine.load). A model built
    from someone's tensors (a reference model's, a state dict the caller keeps) must never be rewritten."""
    before = _in_place.__dict__.get("on", False)
    _in_place.on = True
    try:
        yield
    finally:
        _in_place.on = before


def may_repack_in_place(t: torch.Tensor) -> bool:
    """True inside repack_in_place() for a tensor that owns its memory (owns_memory)."""
    return _in_place.__dict__.get("on", False) and owns_memory(t)


def owns_memory(t: torch.Tensor) -> bool:
    """True when `t` is contiguous and spans its whole storage (no other tensor's view of a larger
    buffer): it may be repacked in place."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes


def untile_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict hook of a module holding parameters in row tiles: their values in order."""
    for name in module.__dict__["_tiled_params"]:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = packing.unpack_float_tiled(state_dict[key])


def tiled_rows(tiles: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of a weight held in row tiles [N, K] -> [T, K] (an embedding lookup)."""
    n, k = tiles.shape
    unit = packing.float_tile_k(tiles.dtype)
    blocks = tiles.view(n // packing.TILE_ROWS, k // unit, packing.TILE_ROWS, unit)
    return blocks[ids // packing.TILE_ROWS, :, ids % packing.TILE_ROWS].reshape(*ids.shape, k)


_scratch = threading.local()  # .buffers: dtype -> matmul_tiled's rows put back in order (<= UPCAST_CHUNK), reused


def untiled_rows(tiles: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [start, stop) (multiples of 8) of a weight held in row tiles, in order and in `dtype`:
    [stop - start, K], a view of a scratch buffer reused by the next call (no fresh pages to fault
    in per call: a fresh 8 MiB tensor cost more than the copy)."""
    k, rows = tiles.shape[1], stop - start
    buffers = _scratch.__dict__.setdefault("buffers", {})  # this thread's
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < rows * k:
        with torch.inference_mode(False):  # a normal tensor: an inference one refuses writes outside inference mode
            buf = buffers[dtype] = torch.empty(rows * k, dtype=dtype)
    out = buf[: rows * k].view(rows, k)
    return packing.row_tiles(tiles[start:stop], packing.TILE_ROWS, packing.float_tile_k(tiles.dtype), False, out=out)


def matmul_tiled(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x W^T + b for W held in row tiles [N, K]: x [..., K] -> [..., N] in out_dtype (default x's),
    rounded once: the kernel adds b to the float32 sums before it stores y, as a decode plan's linear does.

    Where the compiled kernels run: the kernel on the tiles, any number of rows (row i's sums in an
    order fixed by K: batch-invariant). Else (or from tiled_torch_from(dtype) rows): a block of UPCAST_CHUNK
    weights at a time back in order (`untiled_rows`) for torch's GEMM, in float32 where the CPU
    has no native bf16 GEMM (as matmul_t)."""
    x2 = x.reshape(-1, x.shape[-1])
    n, k = tiles.shape
    torch_from = tiled_torch_from(x2.dtype)
    if (torch_from is None or x2.shape[0] < torch_from) and dispatch.use_cpu_kernels(x2, tiles):
        ops = dispatch.cpu_ops()
        b = None if bias is None else bias.float()  # [N] float32, added before the rounding
        y = ops.linear(x2, ops.PackedWeight.tiled(tiles), b, out_dtype or x.dtype)
        return y.view(*x.shape[:-1], n)
    upcast = x2.dtype != torch.float32 and x2.shape[0] > HALF_GEMV_MAX_TOKENS and not native_half_gemm(x2.dtype)
    xc = x2.float() if upcast or x2.dtype == torch.float32 else x2
    step = max(packing.TILE_ROWS, UPCAST_CHUNK // k // packing.TILE_ROWS * packing.TILE_ROWS)
    parts = [torch.nn.functional.linear(xc, untiled_rows(tiles, r, min(r + step, n), xc.dtype))
             for r in range(0, n, step)]  # [T, step] each
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [T, N] (a cat of one copies it)
    if bias is not None:
        y += bias
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


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

    bfloat16 weights at <= KERNEL_MAX_TOKENS rows run the compiled GEMV (core.kernels.cpu), which
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
