"""Token embedding (replicated across tensor-parallel ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    """y[t] = W[ids[t]]: ids [T] -> [T, H]."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
