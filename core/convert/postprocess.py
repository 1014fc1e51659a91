"""Postprocess hooks shared by architectures: `(key, tensors, config) -> {key: tensor}`.

A hook receives the tensor slice(s) the key map fanned a canonical key out to, in the
order of the map's list, already sliced for the rank, and returns the target tensor(s).
Markers change what the loader hands a hook: `slices_itself` (whole tensors + tp_rank=),
`transposes_source` ((in, out) sources sliced along the other dim).

Fused attention projections, whole source -> this rank's [Q_r; K_r; V_r] rows (D = head_size):

    fused_qkv             [Q; K; V] rows              ((H + 2 KVH) D, hidden)   Phi-3 qkv_proj
    fused_qkv_transposed  [Q | K | V] columns         (hidden, (H + 2 KVH) D)   GPT-2 Conv1D c_attn
    per_head_qkv          [q_h k_h v_h] per head      (H 3 D, hidden)           GPT-NeoX, TinyGPT

A fused MLP input, [gate; up] rows (2 I, hidden) (Phi-3 gate_up_proj), mapped to both mlp.fc and
mlp.gate: `gate_rows` / `up_rows` take their half, then this rank's 1/tp of its rows.
"""

from __future__ import annotations

import torch


def identity(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """One source tensor, unchanged."""
    if len(tensors) != 1:
        raise ValueError(f"{key}: {len(tensors)} source tensors for a 1-to-1 key; register a postprocess hook")
    return {key: tensors[0]}


def concat_dim0(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """[A; B; C] along dim 0 (fused qkv from q, k, v: each already this rank's heads)."""
    return {key: torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]}


def slices_itself(hook):
    """Mark a postprocess hook that cuts the rank's part itself.

    The loader then passes it the whole (unsliced) source tensors and `tp_rank=` as a
    keyword: `hook(key, tensors, config, tp_rank=r)`. For layouts a contiguous 1/tp slice
    of each source cannot express, e.g. a fused qkv whose single kv head every rank holds.
    """
    hook.slices_itself = True
    return hook


def transposes_source(hook):
    """Mark a hook whose source is the target with its last two dims swapped: the loader then slices
    the source for a tp rank along the other one (a column-parallel (out, in) target is cut on
    dim 0, so its (in, out) source on dim 1; stacked experts [E, out, in] from [E, in, out] alike)."""
    hook.transposes_source = True
    return hook


@transposes_source
def transpose(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Source stored as (in, out) (Conv1D style): transpose to (out, in)."""
    (tensor,) = tensors
    return {key: tensor.t().contiguous() if tensor.dim() == 2 else tensor}


def _rank_rows(qkv: torch.Tensor, config, tp_rank: int) -> torch.Tensor:
    """Rank `tp_rank`'s [Q_r; K_r; V_r] rows of a whole head-major [Q; K; V] tensor."""
    from bestiary.core.layers.self_attention import qkv_rank_slice

    c = config
    return qkv_rank_slice(qkv, c.num_attention_heads, c.num_key_value_heads, c.head_size, c.mapping.tp_size, tp_rank)


@slices_itself
def fused_qkv(key: str, tensors: list[torch.Tensor], config, tp_rank: int = 0) -> dict[str, torch.Tensor]:
    """One fused [Q; K; V] source ((H + 2 KVH) D rows; weight or bias) -> this rank's rows."""
    (qkv,) = tensors
    return {key: _rank_rows(qkv, config, tp_rank)}


@slices_itself
def fused_qkv_transposed(key: str, tensors: list[torch.Tensor], config, tp_rank: int = 0) -> dict[str, torch.Tensor]:
    """A Conv1D-style fused source: weight (hidden, (H + 2 KVH) D) = [Q | K | V] columns, transposed
    to rows, then this rank's [Q_r; K_r; V_r] rows; a 1-D bias is taken as [Q; K; V]."""
    (qkv,) = tensors
    return {key: _rank_rows(qkv.t() if qkv.dim() == 2 else qkv, config, tp_rank)}


@slices_itself
def per_head_qkv(key: str, tensors: list[torch.Tensor], config, tp_rank: int = 0) -> dict[str, torch.Tensor]:
    """Rows interleaved per head, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (multi-head: KVH = H) -> [Q; K; V]
    -> this rank's rows. [H, 3, D, ...] -> [3, H, D, ...]."""
    (qkv,) = tensors
    heads, d = config.num_attention_heads, config.head_size
    rest = qkv.shape[1:]
    head_major = qkv.reshape(heads, 3, d, *rest).transpose(0, 1).reshape(3 * heads * d, *rest)
    return {key: _rank_rows(head_major, config, tp_rank)}


def _half_rows(fused: torch.Tensor, half: int, config, tp_rank: int) -> torch.Tensor:
    """Rank `tp_rank`'s 1/tp of the rows of half `half` (0: first, 1: second) of a whole [A; B] tensor."""
    part = fused.chunk(2, dim=0)[half]  # [I, ...]
    tp = config.mapping.tp_size
    if part.shape[0] % tp:
        raise ValueError(f"half of shape {tuple(part.shape)} has rows not divisible by tp_size {tp}")
    return part.chunk(tp, dim=0)[tp_rank]


@slices_itself
def gate_rows(key: str, tensors: list[torch.Tensor], config, tp_rank: int = 0) -> dict[str, torch.Tensor]:
    """mlp.fc (activated) from a fused [gate; up] source (2 I rows): the first half, this rank's rows."""
    (fused,) = tensors
    return {key: _half_rows(fused, 0, config, tp_rank)}


@slices_itself
def up_rows(key: str, tensors: list[torch.Tensor], config, tp_rank: int = 0) -> dict[str, torch.Tensor]:
    """mlp.gate (multiplied) from a fused [gate; up] source (2 I rows): the second half, this rank's rows."""
    (fused,) = tensors
    return {key: _half_rows(fused, 1, config, tp_rank)}
