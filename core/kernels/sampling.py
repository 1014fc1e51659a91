"""Top-k / top-p filtering of a batch of logits rows (core.runtime.sampling's semantics, batched).

For row b with logits x [V], k = top_k[b] (0 or >= V: off), p = top_p[b] (1.0: off):

    top-k:  keep x_i >= (k-th largest x)                           (ties at the k-th are kept)
    top-p:  over the top-k survivors, q = softmax(x); keep i when the mass of the tokens
            ranked before i is < p, i.e. sum_{j: x_j > x_i} q_j < p
    every other logit becomes -inf.

The Triton kernel (one program per row) never sorts: it maps each float to an int32 key
with the same order (flip the magnitude bits of negatives) and binary-searches the key
threshold in 32 passes over the row, for the k-th largest key (count of keys >= t >= k)
and then for the smallest key t with mass(keys > t) < p * Z. Ties at the top-p boundary
are all kept (the sorting reference keeps an arbitrary part of a tie).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bestiary.core.kernels.sampling_ref import filter_logits_ref  # noqa: F401 (the reference)

# --- Triton kernel -------------------------------------------------------------------------


@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (IEEE sign-magnitude to two's complement)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _filter_kernel(x_ptr, stride_x, y_ptr, stride_y, top_k_ptr, top_p_ptr, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    k = tl.load(top_k_ptr + row).to(tl.int64)
    p = tl.load(top_p_ptr + row).to(tl.float32)
    thr = tl.full([], -2147483648, tl.int64)  # keep keys >= thr: everything
    if (k > 0) & (k < V):
        lo = tl.full([], -2147483648, tl.int64)  # count(key >= lo) = V >= k
        hi = tl.full([], 2147483648, tl.int64)  # count(key >= hi) = 0 < k
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            count = tl.zeros([], tl.int64)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                key = _order_key(tl.load(x_row + offs, mask=offs < V, other=0.0).to(tl.float32))
                count += tl.sum(((key >= mid) & (offs < V)).to(tl.int64), axis=0)
            ok = count >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        thr = lo  # the k-th largest key
    if p < 1.0:
        m = tl.full([], float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, tl.max(x, axis=0))
        z = tl.zeros([], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            kept = (_order_key(x) >= thr) & (offs < V)
            z += tl.sum(tl.where(kept, tl.exp(x - m), 0.0), axis=0)
        lo = tl.full([], -2147483649, tl.int64)  # mass(key > lo) = Z: not < p Z
        hi = tl.full([], 2147483647, tl.int64)  # mass(key > hi) = 0 < p Z
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            mass = tl.zeros([], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                key = _order_key(x)
                above = (key > mid) & (key >= thr) & (offs < V)
                mass += tl.sum(tl.where(above, tl.exp(x - m), 0.0), axis=0)
            ok = mass < p * z
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
        thr = tl.maximum(thr, hi)  # the smallest key whose predecessors' mass is < p
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + offs, mask=offs < V, other=0.0)
        keep = _order_key(x.to(tl.float32)) >= thr
        tl.store(y_ptr + row * stride_y + offs, tl.where(keep, x, float("-inf")), mask=offs < V)


# --- launcher ------------------------------------------------------------------------------


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, block_v: int | None = None
) -> torch.Tensor:
    """Triton: logits [B, V] -> filtered [B, V]; top_k [B] int, top_p [B] float, on logits' device."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    b, v = logits.shape
    out = torch.empty_like(logits)
    block_v = block_v or min(triton.next_power_of_2(v), 4096)
    _filter_kernel[(b,)](
        logits, logits.stride(0), out, out.stride(0), top_k.to(logits.device), top_p.to(logits.device, torch.float32),
        v, BLOCK_V=block_v,
    )
    return out
