"""The self-attention block: fused qkv projection, rotary, paged attention, output projection.

Checkpoint layout of `attention.qkv.weight`: [Q; K; V] stacked on dim 0, head-major,
((H + 2 * KVH) * D, hidden). On a tensor-parallel rank it holds [Q_r; K_r; V_r], the
rank's own heads (H / tp query heads, KVH / tp kv heads) — the loader slices q, k and v
separately and concatenates them.
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.layers.attention import AttentionMetadata, PagedAttention
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.layers.rotary import Rotary


class SelfAttention(nn.Module):
    """x [T, hidden] -> [T, hidden] for the local heads of rank `tp_rank`."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        qkv_bias: bool = False,
        dense_bias: bool = False,
        rotary: Rotary | None = None,
        alibi: torch.Tensor | None = None,
        scale: float | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        super().__init__()
        if num_heads % tp_size or num_kv_heads % tp_size:
            raise ValueError(
                f"tp_size {tp_size} must divide num_attention_heads {num_heads} and num_key_value_heads {num_kv_heads}"
            )
        self.heads, self.kv_heads, self.head_dim = num_heads // tp_size, num_kv_heads // tp_size, head_dim
        self.qkv = Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias, parallel=Parallel.COLUMN,
                          tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
        self.dense = Linear(num_heads * head_dim, hidden, bias=dense_bias, parallel=Parallel.ROW,
                            tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
        self.rotary = rotary
        self.attn = PagedAttention(head_dim, scale, alibi)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(x, meta.lora).view(t, h + 2 * kvh, d)  # [T, H + 2 KVH, D]
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(meta.positions, qkv.dtype)
            self.rotary.apply(qkv[:, : h + kvh], cos, sin)  # q and k heads in one go
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        out = self.attn(q, k, v, meta, k_pool, v_pool)  # [T, H*D]
        return self.dense(out, meta.lora)
