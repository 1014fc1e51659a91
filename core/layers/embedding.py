"""Token embedding: replicated, or split over tensor-parallel ranks (TensorRT-LLM's
`use_parallel_embedding` with `embedding_sharding_dim`).

    replicated     W [V, H]                 y[t] = W[ids[t]]
    vocab (dim 0)  W_r = W[r V/tp : (r+1) V/tp]   y = all_reduce_r( W_r[ids - r V/tp] if id in range else 0 )
    hidden (dim 1) W_r = W[:, r H/tp : (r+1) H/tp] y = concat_r( W_r[ids] ) along H (all_gather)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bestiary.core.layers import cpu_matmul


class Embedding(nn.Module):
    """ids [T] -> [T, H]; `sharding_dim` None: replicated, 0: vocab-parallel, 1: hidden-parallel.
    Collectives run on `tp_group` (None: the default world; see Linear)."""

    tp_group = None
    _tiles: torch.Tensor | None = None  # a tied bf16 lm_head's row tiles (DecoderLM): the weight's data

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype = torch.float32, device=None,
                 tp_rank: int = 0, tp_size: int = 1, sharding_dim: int | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.sharding_dim = sharding_dim if tp_size > 1 else None
        shape = [vocab_size, hidden]
        if self.sharding_dim is not None:
            if self.sharding_dim not in (0, 1):
                raise ValueError(f"embedding_sharding_dim {sharding_dim}: expected 0 (vocab) or 1 (hidden)")
            if shape[self.sharding_dim] % tp_size:
                what = ("vocab_size", "hidden_size")[self.sharding_dim]
                raise ValueError(f"{what} {shape[self.sharding_dim]} is not divisible by tp_size {tp_size} "
                                 f"(use_parallel_embedding, embedding_sharding_dim {self.sharding_dim})")
            shape[self.sharding_dim] //= tp_size
        self.vocab_start = tp_rank * shape[0] if self.sharding_dim == 0 else 0
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

    def tp_dim(self, param_name: str) -> int:
        """The dim the loader slices the weight along (-1: replicated)."""
        return -1 if self.sharding_dim is None else self.sharding_dim

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` [T] -> [T, H or H/tp]."""
        if self._tiles is not None and ids.device.type == "cpu":
            return cpu_matmul.tiled_rows(self._tiles, ids)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.sharding_dim == 0:
            local = ids - self.vocab_start  # [T]
            inside = (local >= 0) & (local < self.weight.shape[0])
            y = self._rows(local.clamp(0, self.weight.shape[0] - 1)) * inside.unsqueeze(-1)
            torch.distributed.all_reduce(y, group=self.tp_group)  # each id's row comes from the one rank holding it
            return y
        y = self._rows(ids)  # [T, H or H/tp]
        if self.sharding_dim == 1:
            parts = [torch.empty_like(y) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, y.contiguous(), group=self.tp_group)
            y = torch.cat(parts, dim=-1)  # [T, H]
        return y
