"""MoE: top-k routing and the grouped expert GEMM over expert-sorted slots."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import ALL_DTYPES, DOT_DTYPES, assert_close, assert_far

from bestiary.core.kernels import dispatch
from bestiary.core.layers.moe import route

moe = dispatch.family("moe")
E, TOP_K, T = 5, 2, 7


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_route(renormalize, dtype, device):
    logits = (torch.randn(T, E) * 2).to(dtype).to(device)
    w, ids = moe.moe_route(logits, TOP_K, renormalize)
    w_ref, ids_ref = moe.moe_route_ref(logits, TOP_K, renormalize)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    assert_close(w, w_ref, torch.float32)


def test_route_matches_the_moe_layer(device):
    """Softmax-all + top-k + renormalise == the layer's softmax over the top-k logits."""
    logits = torch.randn(T, E).to(device)
    w, ids = moe.moe_route(logits, TOP_K)
    w_layer, ids_layer = route(logits, TOP_K)
    assert torch.equal(ids.cpu(), ids_layer.cpu())
    assert_close(w, w_layer, torch.float32)


def test_align_slots_groups_by_expert(device):
    experts = torch.tensor([[0, 3], [3, 1], [0, 3], [4, 0]]).to(device)
    slots, block_expert = moe.align_slots(experts, E, 4)
    slots, block_expert = slots.cpu(), block_expert.cpu()
    n = experts.numel()
    assert sorted(s for s in slots.tolist() if s < n) == list(range(n))  # every slot once
    for b, e in enumerate(block_expert.tolist()):
        tile = [s for s in slots[4 * b : 4 * b + 4].tolist() if s < n]
        assert all(experts.flatten()[s] == e for s in tile), f"tile {b} mixes experts"
        assert e >= 0 or not tile


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("k_dim,n_dim", [(96, 129), (129, 40)])
def test_grouped_gemm(k_dim, n_dim, dtype, device):
    a = torch.randn(T, k_dim).to(dtype).to(device)
    w = (torch.randn(E, n_dim, k_dim) / k_dim**0.5).to(dtype).to(device)
    experts = torch.randint(0, E, (T, TOP_K)).to(device)
    slot_w = torch.rand(T, TOP_K).to(device)
    out = moe.grouped_gemm(a, w, experts, TOP_K, slot_w, block_m=16, block_n=32, block_k=32)
    assert_close(out, moe.grouped_gemm_ref(a, w, experts, TOP_K, slot_w), dtype)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("gated", [True, False])
def test_fused_moe(gated, dtype, device):
    h, inter = 96, 40
    x = torch.randn(T, h).to(dtype).to(device)
    w_fc = (torch.randn(E, inter, h) / h**0.5).to(dtype).to(device)
    w_gate = (torch.randn(E, inter, h) / h**0.5).to(dtype).to(device) if gated else None
    w_proj = (torch.randn(E, h, inter) / inter**0.5).to(dtype).to(device)
    weights, experts = moe.moe_route_ref(torch.randn(T, E).to(device), TOP_K)
    out = moe.fused_moe(x, w_fc, w_gate, w_proj, weights, experts, "silu" if gated else "gelu")
    ref = moe.fused_moe_ref(x, w_fc, w_gate, w_proj, weights, experts, "silu" if gated else "gelu")
    assert_close(out, ref, dtype)


def test_broken_variant_misses(device):
    """Routing weights dropped (every expert weighted 1)."""
    a = torch.randn(T, 96).to(device)
    w = torch.randn(E, 129, 96).to(device) / 10
    experts = torch.randint(0, E, (T, TOP_K)).to(device)
    slot_w = torch.rand(T, TOP_K).to(device) * 0.5
    out = moe.grouped_gemm(a, w, experts, TOP_K, None)
    assert_far(out, moe.grouped_gemm_ref(a, w, experts, TOP_K, slot_w), torch.float32)
