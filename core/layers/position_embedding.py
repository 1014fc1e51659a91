"""Learned absolute position embedding (replicated across tensor-parallel ranks).

    y[t] = W[positions[t] + offset]

`offset` is the number of leading table rows no position uses: OPT's table has
max_position_embeddings + 2 rows and position p reads row p + 2 (rows 0 and 1 are a
leftover of fairseq's padding-aware positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LearnedPositionEmbedding(nn.Module):
    """positions [T] -> [T, dim] from a table [num_positions + offset, dim]."""

    def __init__(
        self, num_positions: int, dim: int, offset: int = 0, dtype: torch.dtype = torch.float32, device=None
    ) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(
            torch.empty(num_positions + offset, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] (int64) -> [T, dim]."""
        return F.embedding(positions + self.offset, self.weight)

    def extra_repr(self) -> str:
        return f"rows={self.weight.shape[0]}, dim={self.weight.shape[1]}, offset={self.offset}"
