"""Postprocess hooks shared by architectures: `(key, tensors, config) -> {key: tensor}`.

A hook receives the tensor slice(s) the key map fanned a canonical key out to, in the
order of the map's list, already sliced for the rank, and returns the target tensor(s).
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


def transposes_source(hook):
    """Mark a hook whose 2-D source is the target transposed: the loader then slices the
    source for a tp rank along the other dim (a column-parallel (out, in) target is cut on
    dim 0, so its (in, out) source on dim 1)."""
    hook.transposes_source = True
    return hook


@transposes_source
def transpose(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Source stored as (in, out) (Conv1D style): transpose to (out, in)."""
    (tensor,) = tensors
    return {key: tensor.t().contiguous() if tensor.dim() == 2 else tensor}
