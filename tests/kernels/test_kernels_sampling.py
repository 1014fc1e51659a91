"""Sampling: batched top-k / top-p filtering with core.runtime.sampling's semantics."""

from __future__ import annotations

import torch
from kernel_helpers import assert_far

from bestiary.core.kernels import dispatch

sampling = dispatch.family("sampling")

# (top_k, top_p) per row: off, top-k only, top-p only, both, k = V (off), k = 1 (greedy).
ROWS = [(0, 1.0), (5, 1.0), (0, 0.7), (40, 0.5), (300, 1.0), (1, 0.9)]


def test_filter_logits_rows(device):
    logits = torch.randn(len(ROWS), 300).to(device)
    top_k = torch.tensor([k for k, _ in ROWS], device=device)
    top_p = torch.tensor([p for _, p in ROWS], device=device)
    out = sampling.filter_logits(logits, top_k, top_p, block_v=128)  # 3 chunks, the last partial
    ref = sampling.filter_logits_ref(logits, top_k, top_p)
    kept = torch.isfinite(out).sum(-1).tolist()
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref)), f"kept {kept} vs {torch.isfinite(ref).sum(-1)}"
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])
    assert kept[0] == 300 and kept[1] == 5 and kept[4] == 300 and kept[5] == 1 and 1 < kept[2] < 300


def test_negative_and_bf16_logits(device):
    """The float -> ordered-int key handles negatives; bf16 logits come back in bf16.

    Distinct values (multiples of 1/16, exact in bf16): at a tie the reference keeps an
    arbitrary part of it and the kernel all of it.
    """
    logits = torch.stack([-torch.randperm(129) / 16 for _ in range(2)]).to(torch.bfloat16).to(device)
    top_k, top_p = torch.tensor([7, 0], device=device), torch.tensor([1.0, 0.6], device=device)
    out = sampling.filter_logits(logits, top_k, top_p, block_v=64)
    ref = sampling.filter_logits_ref(logits.float(), top_k, top_p)
    assert out.dtype == torch.bfloat16
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))


def test_broken_variant_misses(device):
    """top_k off by one keeps a different set (the filtered logits differ by inf)."""
    logits = torch.randn(2, 129).to(device)
    top_p = torch.ones(2, device=device)
    out = sampling.filter_logits(logits, torch.tensor([4, 9], device=device), top_p)
    ref = sampling.filter_logits_ref(logits, torch.tensor([5, 10], device=device), top_p)
    assert_far(torch.nan_to_num(out, neginf=-1e4), torch.nan_to_num(ref, neginf=-1e4), torch.float32)


def test_dispatch_filters_a_batch(device):
    logits = torch.randn(3, 129).to(device)
    top_k, top_p = torch.tensor([0, 7, 20], device=device), torch.tensor([0.8, 1.0, 0.5], device=device)
    with dispatch.kernels_mode("triton"):
        out = dispatch.filter_logits(logits, top_k, top_p)
    with dispatch.kernels_mode("torch"):
        ref = dispatch.filter_logits(logits, top_k, top_p)
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref)) and 1 < int(torch.isfinite(out).sum()) < 3 * 129
