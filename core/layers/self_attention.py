"""The self-attention block: fused qkv projection, rotary, paged attention, output projection.

Checkpoint layout of `attention.qkv.weight`: [Q; K; V] stacked on dim 0, head-major,
((H + 2 * KVH) * D, hidden). On a tensor-parallel rank it holds [Q_r; K_r; V_r], the
rank's own heads (H / tp query heads, KVH / tp kv heads) — the loader slices q, k and v
separately (k and v by whole kv heads: `WeightsLoader.source_part`) and concatenates them.

With fewer kv heads than ranks (MQA, or GQA with KVH < tp; tp must then be a multiple of
KVH) each rank holds the one kv head its query heads use, replicated on tp / KVH ranks:
rank r holds query heads [r H/tp, (r+1) H/tp) and kv head r KVH // tp.
`qkv_rank_slice` cuts a rank's rows out of a whole [Q; K; V] tensor either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bestiary.core.kernels.metadata import AttentionMetadata, KeyBias
from bestiary.core.layers.attention import PagedAttention
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.layers.rotary import Rotary
from bestiary.core.layers.rotary_2d import Rotary2D


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The kv heads rank `tp_rank` holds: its KVH / tp share, or, when tp is a multiple of
    KVH, the single kv head r * KVH // tp that its query heads attend with (replicated)."""
    if num_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide num_attention_heads {num_heads}")
    if num_kv_heads % tp_size == 0:
        per_rank = num_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size % num_kv_heads == 0:
        head = tp_rank * num_kv_heads // tp_size
        return range(head, head + 1)
    raise ValueError(
        f"tp_size {tp_size} must divide num_key_value_heads {num_kv_heads} or be a multiple of it"
    )


def qkv_rank_slice(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int
) -> torch.Tensor:
    """Rank `tp_rank`'s rows [Q_r; K_r; V_r] of a whole head-major qkv weight or bias.

    qkv [(H + 2 KVH) * D, ...] -> [(H / tp + 2 KVH_r) * D, ...], KVH_r = len(kv_heads_of_rank(...)).
    """
    d = head_dim
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d])
    per_rank = num_heads // tp_size
    kv = kv_heads_of_rank(num_heads, num_kv_heads, tp_size, tp_rank)
    q_r = q[tp_rank * per_rank * d : (tp_rank + 1) * per_rank * d]  # [H/tp * D, ...]
    k_r, v_r = k[kv.start * d : kv.stop * d], v[kv.start * d : kv.stop * d]  # [KVH_r * D, ...]
    return torch.cat([q_r, k_r, v_r])


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
        rotary: Rotary | Rotary2D | None = None,
        alibi: torch.Tensor | None = None,
        scale: float | None = None,
        key_bias: KeyBias | None = None,
        dtype: torch.dtype = torch.float32,
        device=None,
        qk_norm: Callable[[int], nn.Module] | None = None,
        attn: PagedAttention | None = None,
    ) -> None:
        super().__init__()
        kv_heads = kv_heads_of_rank(num_heads, num_kv_heads, tp_size, tp_rank)
        self.heads, self.kv_heads, self.head_dim = num_heads // tp_size, len(kv_heads), head_dim
        # out_features counts a replicated kv head once per rank that holds it: (H + 2 KVH_r tp) * D.
        self.qkv = Linear(hidden, (num_heads + 2 * self.kv_heads * tp_size) * head_dim, bias=qkv_bias,
                          parallel=Parallel.COLUMN, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype,
                          device=device)
        self.dense = Linear(num_heads * head_dim, hidden, bias=dense_bias, parallel=Parallel.ROW,
                            tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
        self.rotary = rotary
        self.attn = attn or PagedAttention(head_dim, scale, alibi, key_bias)  # a family's own op (Qwen's logn)
        # QK-norm (Exaone4): a norm over each q / k head's D dims, before rotary; qk_norm(D) builds one.
        self.q_norm = qk_norm(head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(head_dim) if qk_norm is not None else None

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(x, meta.lora).view(t, h + 2 * kvh, d)  # [T, H + 2 KVH, D]
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            qkv[:, :h] = self.q_norm(qkv[:, :h].reshape(t * h, d)).view(t, h, d)
            qkv[:, h : h + kvh] = self.k_norm(qkv[:, h : h + kvh].reshape(t * kvh, d)).view(t, kvh, d)
        if self.rotary is not None:
            # shared by all layers of a step; for bf16 on the CPU float32, as a compiled decode plan rotates: a row
            # comes out the same in an eager step and a plan's (batch invariance, docs/runtime.md). float16 keeps
            # its own tables: FastLLM's float16 CPU models rotate so (tests/sources/test_flm_fastllm.py)
            table = torch.float32 if qkv.device.type == "cpu" and qkv.dtype == torch.bfloat16 else qkv.dtype
            cos, sin = self.rotary.step_cos_sin(meta, table)
            self.rotary.rotate(qkv[:, : h + kvh], cos, sin)  # q and k heads in one go
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        out = self.attn(q, k, v, meta, k_pool, v_pool)  # [T, H*D]
        return self.dense(out, meta.lora)
