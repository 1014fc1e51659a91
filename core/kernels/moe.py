"""Mixture of experts: top-k routing and the grouped expert GEMM (the fused-MoE shape).

Routing, for router logits l [T, E] and K = top_k:

    p = softmax(l) (float32);  S_t = the K experts with the largest p_t,e
    w_t,k = p_t,S_t[k] / sum_{e in S_t} p_t,e   (renormalize; else w = p)

equal to a softmax over the K kept logits (core.layers.moe.route).

Experts (weights stacked on a leading expert dim, as in the checkpoint):
w_fc [E, I, H] (gate_proj), w_gate [E, I, H] (up_proj, None for a plain MLP expert),
w_proj [E, H, I] (down_proj):

    expert_e(x) = w_proj[e] (act(w_fc[e] x) * (w_gate[e] x))
    y_t = sum_k w_t,k expert_{S_t[k]}(x_t)

Slot s = t * K + k is token t's k-th choice. The grouped GEMM sorts the T*K slots by
expert and pads each expert's run to a multiple of BLOCK_M (`align_slots`), so every
BLOCK_M tile of sorted slots belongs to one expert; one launch then computes
c[s] = a[s // a_div] @ w[e(s)]^T (times w_s when given) for all experts at once.
`fused_moe` = grouped GEMM (fc, gate) -> act_and_mul -> grouped GEMM (proj, weighted)
-> sum over K. The torch reference loops over the experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bestiary.core.kernels.activations import act_and_mul, act_and_mul_ref, activation, activation_ref
from bestiary.core.kernels.attention import dot_precision

# --- torch references ----------------------------------------------------------------------


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] float32, experts [T, K] int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def grouped_gemm_ref(
    a: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, a_div: int, slot_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """c [S, N] with c[s] = a[s // a_div] @ w[experts.flat[s]]^T (* slot_weights.flat[s]); loops over experts."""
    flat = experts.reshape(-1)
    out = torch.zeros(flat.numel(), w.shape[1], dtype=a.dtype, device=a.device)
    for e in flat.unique().tolist():
        slots = torch.nonzero(flat == e).squeeze(1)  # [N_e]
        y = a.index_select(0, slots // a_div) @ w[e].t()
        if slot_weights is not None:
            y = y * slot_weights.reshape(-1)[slots, None].to(y.dtype)
        out[slots] = y
    return out


def fused_moe_ref(
    x: torch.Tensor, w_fc: torch.Tensor, w_gate: torch.Tensor | None, w_proj: torch.Tensor,
    weights: torch.Tensor, experts: torch.Tensor, act: str,
) -> torch.Tensor:
    """x [T, H] -> [T, H]: for each expert, its tokens through fc/gate/proj, weighted, summed."""
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        tokens, slots = torch.where(experts == e)  # [N], [N]
        xe = x.index_select(0, tokens)
        f = xe @ w_fc[e].t()
        h = act_and_mul_ref(f, xe @ w_gate[e].t(), act) if w_gate is not None else activation_ref(f, act)
        y = h @ w_proj[e].t()
        out.index_add_(0, tokens, (y * weights[tokens, slots, None]).to(out.dtype))
    return out


# --- Triton kernels ------------------------------------------------------------------------


@triton.jit
def _route_kernel(
    logits_ptr, stride_l, w_ptr, id_ptr, n_experts,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < n_experts
    logit = tl.load(logits_ptr + t * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(logit - tl.max(logit, axis=0))
    probs = e / tl.sum(e, axis=0)
    remaining = tl.where(mask, probs, -1.0)
    scale = 1.0
    if RENORMALIZE:  # 1 / (mass of the top-k), from a first pass over the same selection
        total = 0.0
        r = remaining
        for _ in tl.static_range(TOP_K):
            best = tl.argmax(r, axis=0)
            total += tl.max(r, axis=0)
            r = tl.where(offs == best, -1.0, r)
        scale = 1.0 / total
    for k in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=0)
        tl.store(id_ptr + t * TOP_K + k, best.to(tl.int64))
        tl.store(w_ptr + t * TOP_K + k, tl.max(remaining, axis=0) * scale)
        remaining = tl.where(offs == best, -1.0, remaining)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, stride_am,
    w_ptr, stride_we, stride_wn,
    c_ptr, stride_cm,
    sorted_ptr, block_expert_ptr, slot_w_ptr,
    num_slots, N, K, a_div,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < 0:  # a tile past the last expert's run
        return
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # padding = num_slots
    m_mask = slots < num_slots
    rows = (slots // a_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N] = w[e]^T tile
        acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PREC)
    if HAS_WEIGHT:
        acc *= tl.load(slot_w_ptr + slots, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --- launchers -----------------------------------------------------------------------------


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton routing: logits [T, E] -> (weights [T, K] float32, experts [T, K] int64)."""
    t, n_experts = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    _route_kernel[(t,)](logits, logits.stride(0), weights, experts, n_experts,
                        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(n_experts))
    return weights, experts


def align_slots(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert, each expert's run padded to a multiple of block_m (no host sync).

    experts [T, K] -> (sorted_slots [M_max] int32, padding = T*K; block_expert [M_max / block_m] int32, -1 = unused),
    with M_max = (cdiv(T*K, block_m) + E) * block_m, an upper bound on the padded length.
    """
    flat = experts.reshape(-1)
    n = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts  # first sorted index of each expert
    pstart = torch.cumsum(padded, 0) - padded  # first padded index of each expert
    e_sorted = flat[order]
    dest = pstart[e_sorted] + torch.arange(n, device=dev) - start[e_sorted]
    num_blocks = triton.cdiv(n, block_m) + num_experts
    sorted_slots = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_slots[dest] = order.to(torch.int32)
    block_ends = torch.cumsum(padded // block_m, 0)  # [E] first block past each expert
    block_expert = torch.searchsorted(block_ends, torch.arange(num_blocks, device=dev), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots, block_expert


def grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, a_div: int, slot_weights: torch.Tensor | None = None,
    block_m: int = 16, block_n: int = 64, block_k: int = 32,
    aligned: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton grouped GEMM: c [S, N], c[s] = a[s // a_div] @ w[experts.flat[s]]^T (* slot_weights.flat[s])."""
    n_slots = experts.numel()
    sorted_slots, block_expert = aligned if aligned is not None else align_slots(experts, w.shape[0], block_m)
    a = a if a.stride(-1) == 1 else a.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(n_slots, n, dtype=a.dtype, device=a.device)
    sw = slot_weights.reshape(-1).contiguous() if slot_weights is not None else a
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, a.stride(0), w, w.stride(0), w.stride(1), out, out.stride(0),
        sorted_slots, block_expert, sw, n_slots, n, k, a_div,
        HAS_WEIGHT=slot_weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PREC=dot_precision(a.dtype),
    )
    return out


def fused_moe(
    x: torch.Tensor, w_fc: torch.Tensor, w_gate: torch.Tensor | None, w_proj: torch.Tensor,
    weights: torch.Tensor, experts: torch.Tensor, act: str, block_m: int = 16,
) -> torch.Tensor:
    """Triton MoE: x [T, H] -> [T, H], two grouped GEMMs around the fused activation."""
    t, top_k = experts.shape
    aligned = align_slots(experts, w_fc.shape[0], block_m)
    f = grouped_gemm(x, w_fc, experts, top_k, block_m=block_m, aligned=aligned)  # [T*K, I]
    if w_gate is not None:
        h = act_and_mul(f, grouped_gemm(x, w_gate, experts, top_k, block_m=block_m, aligned=aligned), act)
    else:
        h = activation(f, act)
    y = grouped_gemm(h, w_proj, experts, 1, weights, block_m=block_m, aligned=aligned)  # [T*K, H], weighted
    return y.view(t, top_k, -1).sum(dim=1)
