"""Top-k / top-p filtering of logits in torch: the sampler's (core.runtime.sampling) and the reference
of the batched Triton kernel (core.kernels.sampling).

For a row x [V], k = top_k (0 or >= V: off), p = top_p (1.0: off): top-k keeps x_i >= the k-th largest;
top-p then drops every token whose sorted probability mass strictly before it is already >= p (so one
token always stays); every other logit becomes -inf.
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with everything outside top-k / top-p set to -inf.

    top-k keeps logits >= the k-th largest; top-p then drops every token whose sorted
    probability mass strictly before it is already >= top_p (so one token always stays).
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def filter_logits_ref(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> filtered [B, V], row by row with filter_logits."""
    rows = [filter_logits(row, int(k), float(p)) for row, k, p in zip(logits, top_k.tolist(), top_p.tolist())]
    return torch.stack(rows) if rows else logits.clone()
