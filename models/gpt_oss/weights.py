"""gpt-oss's postprocess hooks: HF's stacked (in, out) experts -> the canonical [E, out, in] ones.

The source gate_up_proj [E, H, 2I] interleaves gate and up along its last dim (transformers'
GptOssExperts: gate = [..., ::2], up = [..., 1::2]). A tensor-parallel rank reads a contiguous
2I / tp slice of that dim (`transposes_source`: the loader cuts the source's last dim for the
target's out dim), which holds exactly the gate and up columns of its I / tp features, so each
hook takes every other column of the rank's slice:

    fc.weight[e]   = gate_up_proj[e][:, 0::2]^T     [I/tp, H]       fc.bias   = gate_up_proj_bias[:, 0::2]
    gate.weight[e] = gate_up_proj[e][:, 1::2]^T     [I/tp, H]       gate.bias = gate_up_proj_bias[:, 1::2]
    proj.weight[e] = down_proj[e]^T                 [H, I/tp]       proj.bias = down_proj_bias (whole)
"""

from __future__ import annotations

import torch

from bestiary.core.convert.postprocess import transposes_source


def _experts(key: str, tensors: list[torch.Tensor], dims: int) -> torch.Tensor:
    """The one stacked source of `key`, checked to have `dims` dims."""
    if len(tensors) != 1 or tensors[0].dim() != dims:
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"{key}: expected one stacked expert tensor of {dims} dims, got shapes {shapes}")
    return tensors[0]


@transposes_source
def gate_columns(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """gate_up_proj [E, H, 2I_r] -> fc.weight [E, I_r, H]: the even (gate) columns, transposed."""
    return {key: _experts(key, tensors, 3)[..., 0::2].transpose(1, 2)}


@transposes_source
def up_columns(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """gate_up_proj [E, H, 2I_r] -> gate.weight [E, I_r, H]: the odd (up) columns, transposed."""
    return {key: _experts(key, tensors, 3)[..., 1::2].transpose(1, 2)}


def gate_bias(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """gate_up_proj_bias [E, 2I_r] -> fc.bias [E, I_r]: the even (gate) entries."""
    return {key: _experts(key, tensors, 2)[:, 0::2]}


def up_bias(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """gate_up_proj_bias [E, 2I_r] -> gate.bias [E, I_r]: the odd (up) entries."""
    return {key: _experts(key, tensors, 2)[:, 1::2]}


@transposes_source
def transpose_experts(key: str, tensors: list[torch.Tensor], config) -> dict[str, torch.Tensor]:
    """down_proj [E, I_r, H] -> proj.weight [E, H, I_r]."""
    return {key: _experts(key, tensors, 3).transpose(1, 2)}
