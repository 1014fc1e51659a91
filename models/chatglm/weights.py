"""ChatGLM postprocess hooks: fused qkv and stacked gate/up sources into bestiary's layout.

Targets (see `core/layers/self_attention.py`, `core/layers/mlp.py`):
  attention.qkv: [Q_r; K_r; V_r] head-major, the rank's query heads and its kv heads.
  mlp.fc / mlp.gate: the rank's 1/tp share of the rows of the gate (activated) / up projection.

Sources:
  v1 `query_key_value`: rows [q_0 k_0 v_0 q_1 k_1 v_1 ...] (D rows each): a contiguous
    1/tp slice holds whole heads, so the loader's own slicing is right and the hook only
    regroups it.
  v2 `query_key_value`: rows [Q (H*D); K (KVH*D); V (KVH*D)] (multi_query_attention) or
    per head as in v1; HF glm: separate q_proj, k_proj, v_proj.
  `dense_h_to_4h` / `gate_up_proj`: rows [gate (I); up (I)].
The v2 hooks take the whole source tensors (`slices_itself`) and cut the rank's part of
each piece themselves; for qkv with `qkv_rank_slice`, which also replicates kv heads
when tp exceeds them.
"""

from __future__ import annotations

import torch

from bestiary.core.convert.loader import slices_itself
from bestiary.core.layers.self_attention import qkv_rank_slice


def rank_rows(t: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank `tp_rank`'s contiguous 1/tp_size share of dim 0."""
    if t.shape[0] % tp_size:
        raise ValueError(f"dim 0 of shape {tuple(t.shape)} is not divisible by tp_size {tp_size}")
    return t.chunk(tp_size, dim=0)[tp_rank]


def deinterleave_heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """[q_0 k_0 v_0 q_1 k_1 v_1 ...] -> [Q; K; V] along dim 0 (weight [3*n*D, in] or bias [3*n*D])."""
    heads = t.shape[0] // (3 * head_size)
    if heads * 3 * head_size != t.shape[0]:
        raise ValueError(f"dim 0 of shape {tuple(t.shape)} is not a multiple of 3 * head_size {head_size}")
    grouped = t.reshape(heads, 3, head_size, *t.shape[1:])  # [n, 3, D, ...]
    return grouped.transpose(0, 1).reshape(t.shape)  # [3, n, D, ...] -> [3*n*D, ...]


def qkv_per_head(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """ChatGLM v1 query_key_value (already this rank's heads) -> [Q_r; K_r; V_r]."""
    (t,) = tensors
    return {key: deinterleave_heads(t, config.head_size)}


@slices_itself
def qkv_v2(key: str, tensors: list[torch.Tensor], config, tp_rank: int) -> dict[str, torch.Tensor]:
    """ChatGLM2/3 query_key_value or HF glm [q_proj, k_proj, v_proj] (whole) -> [Q_r; K_r; V_r]."""
    h, kvh, d = config.num_attention_heads, config.num_key_value_heads, config.head_size
    if len(tensors) == 3:  # HF glm: q_proj, k_proj, v_proj
        whole = torch.cat(tensors)
    elif config.multi_query_attention:
        whole = tensors[0]
    else:
        whole = deinterleave_heads(tensors[0], d)
    if whole.shape[0] != (h + 2 * kvh) * d:
        raise ValueError(
            f"qkv of shape {tuple(whole.shape)} has not (H + 2 KVH) * D = {(h + 2 * kvh) * d} rows"
        )
    return {key: qkv_rank_slice(whole, h, kvh, d, config.mapping.tp_size, tp_rank)}


@slices_itself
def gate_half(key: str, tensors: list[torch.Tensor], config, tp_rank: int) -> dict[str, torch.Tensor]:
    """mlp.fc (the activated half): the first half of dense_h_to_4h / gate_up_proj, rank rows."""
    (t,) = tensors
    return {key: rank_rows(t.chunk(2, dim=0)[0], tp_rank, config.mapping.tp_size)}


@slices_itself
def up_half(key: str, tensors: list[torch.Tensor], config, tp_rank: int) -> dict[str, torch.Tensor]:
    """mlp.gate (the multiplied half): the second half of dense_h_to_4h / gate_up_proj, rank rows."""
    (t,) = tensors
    return {key: rank_rows(t.chunk(2, dim=0)[1], tp_rank, config.mapping.tp_size)}
