"""Falcon's fused query_key_value rows -> bestiary's [Q; K; V] head-major layout, per rank.

Rows of an HF Falcon query_key_value weight (bias alike), D = head_dim, G = H / KVH:

    classic multi-head   [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]            (H, 3, D)
    classic multi-query  [q_0 ... q_{H-1} | k | v]                     (H + 2, D): already head-major
    new decoder (40B)    [q_{g,0} .. q_{g,G-1} k_g v_g | g = 0..KVH-1]  (KVH, G + 2, D)

The hook reorders the whole tensor, then cuts the rank's [Q_r; K_r; V_r] rows
(`qkv_rank_slice`): query heads split evenly, kv heads split or, when there are fewer kv
heads than ranks, the one kv head each rank's queries use, replicated.
"""

from __future__ import annotations

import torch

from bestiary.core.convert.loader import slices_itself
from bestiary.core.layers.self_attention import qkv_rank_slice


def classic_to_head_major(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """(H, 3, D, ...) per-head interleave -> [Q; K; V] (3, H, D, ...), flattened to rows."""
    rest = w.shape[1:]
    return w.reshape(heads, 3, head_dim, *rest).transpose(0, 1).reshape(3 * heads * head_dim, *rest)


def grouped_to_head_major(w: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """(KVH, G + 2, D, ...) per-kv-group interleave -> [Q (H D); K (KVH D); V (KVH D)] rows."""
    rest = w.shape[1:]
    group = heads // kv_heads
    w = w.reshape(kv_heads, group + 2, head_dim, *rest)
    q = w[:, :group].reshape(heads * head_dim, *rest)  # query head g * G + i of group g
    k = w[:, group].reshape(kv_heads * head_dim, *rest)
    v = w[:, group + 1].reshape(kv_heads * head_dim, *rest)
    return torch.cat([q, k, v])


def to_head_major(w: torch.Tensor, config) -> torch.Tensor:
    """A whole HF Falcon qkv weight [(H + 2 KVH) D, hidden] (or bias) in [Q; K; V] head-major order."""
    h, kvh, d = config.num_attention_heads, config.num_key_value_heads, config.head_size
    expected = (h + 2 * kvh) * d
    if w.shape[0] != expected:
        raise ValueError(
            f"query_key_value has {w.shape[0]} rows, expected (H {h} + 2 * KVH {kvh}) * D {d} = {expected}"
        )
    if config.new_decoder_architecture:
        return grouped_to_head_major(w, h, kvh, d)
    if kvh == 1:
        return w  # classic multi-query: [Q; K; V] already
    return classic_to_head_major(w, h, d)


@slices_itself
def qkv_to_head_major(
    key: str, tensors: list[torch.Tensor], config, tp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """Postprocess of attention.qkv.{weight,bias}: the whole source -> this rank's [Q_r; K_r; V_r]."""
    (w,) = tensors
    c = config
    qkv = to_head_major(w, c)
    return {key: qkv_rank_slice(qkv, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                                c.mapping.tp_size, tp_rank)}
