"""Quantizing while converting from a float source.

The loader fills float targets; for a quantized Linear the targets it is asked for are the
float weight [N_local, K_local] (float32, so quantization sees the source's precision, not
the checkpoint dtype's rounding) and the bias. `quantize_loaded` turns that float weight
into the packed weight + scales the rank file declares (layouts in core.format.packing).

Calibrated modes on tp ranks are quantized once on the whole model and then cut (`rank_part`,
core.convert.quantize_calibrated.write_sharded_rank), with the split rules the loader applies to the float
weights, read from each target's tp_dim (the slots' declarations: WeightOnlySlot.tp_dim,
ActQuantSlot.tp_dim).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeAlias

import torch
from torch import nn

from bestiary.core.convert.loader import Target
from bestiary.core.quant.act_slot import SCALE_NAMES as ACT_SCALE_NAMES
from bestiary.core.quant.act_slot import ActQuantSlot
from bestiary.core.quant.apply import quantized_linears
from bestiary.core.quant.kv import SCALE_NAME as KV_SCALE_NAME
from bestiary.core.quant.slot import SCALE_NAMES, WeightOnlySlot

PackingSlot: TypeAlias = WeightOnlySlot | ActQuantSlot  # what packs a quantized linear's float weight at convert


def loader_targets(
    model: nn.Module, targets: list[Target], prequantized: bool = False
) -> tuple[list[Target], dict[str, PackingSlot], list[Target]]:
    """(what the loader fills, weight key -> slot of each quantized weight, tensors made later).

    A quantized Linear's packed weight becomes its float weight target; its scale tensors are
    left out (they are made from the weight). KV cache scales are written as placeholders and
    calibrated once the whole checkpoint is written (core.convert.kv_scales). `prequantized`
    (AWQ/GPTQ imports, core.convert.import_prequantized): the source holds the packed tensors, read as they are."""
    linears = quantized_linears(model)
    reads: list[Target] = []
    slots: dict[str, PackingSlot] = {}
    later: list[Target] = []
    for t in targets:
        linear = linears.get(t.module_path)
        name = t.key.rpartition(".")[2]
        if name == KV_SCALE_NAME:
            later.append(t)
        elif linear is None or name == "bias" or prequantized:
            reads.append(t)
        elif name == "weight":
            slot = linear.quant
            assert isinstance(slot, (WeightOnlySlot, ActQuantSlot)), "quantized_linears: a slot of core.quant"
            reads.append(replace(t, shape=(slot.out_local, slot.in_local), dtype=torch.float32))
            slots[t.key] = slot
        elif name not in SCALE_NAMES + ACT_SCALE_NAMES:
            raise ValueError(f"{t.key}: unexpected tensor of a quantized linear")
    return reads, slots, later


def quantize_loaded(key: str, weight: torch.Tensor, slot: PackingSlot, scale_dtype: torch.dtype,
                    stats=None, row_amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Float weight of `key` (ending in .weight) -> {checkpoint key: tensor} of the packed weight and its
    scales; `stats`: the layer's calibration input statistics (core.convert.quantize_calibrated), if any;
    `row_amax`: see needs_row_amax."""
    if row_amax is not None:
        assert isinstance(slot, WeightOnlySlot), "row_amax: int8 weight-only (needs_row_amax)"
        return checkpoint_names(key, slot.quantize(weight, scale_dtype, row_amax=row_amax))
    packed = slot.quantize(weight, scale_dtype) if stats is None else slot.quantize(weight, scale_dtype, stats)
    return checkpoint_names(key, packed)


def needs_row_amax(target: Target, slot: PackingSlot, tp_size: int) -> bool:
    """Whether a rank's int8 weight-only weight is the columns of a row-parallel layer (weight tp_dim 1) on
    tp > 1: its per-channel scales are replicated (WeightOnlySlot.tp_dim), so they must come from the whole
    rows, as at tp 1, not from the rank's columns. (Activation-quantized slots are calibrated on the whole
    model and cut: core.convert.quantize_calibrated.)"""
    return isinstance(slot, WeightOnlySlot) and tp_size > 1 and slot.lq.bits == 8 and target.tp_dim == 1


def rank_part(target: Target, whole: torch.Tensor, config, tp_rank: int) -> torch.Tensor:
    """Rank `tp_rank`'s part of `whole`, the tp 1 checkpoint's tensor of `target` (any tensor: packed
    weight, scales, zero points, prequant / activation scales, bias, norms), split as the loader
    splits the float weights:

        tp_dim -1          the whole tensor (replicated)
        attention.qkv, 0   [Q_r; K_r; V_r] of the whole [Q; K; V] rows (qkv_rank_slice: the rank's
                           H / tp query heads and kv_heads_of_rank's whole kv heads, replicated on
                           tp / KVH ranks when KVH < tp, as the q/k/v fan-out reads them)
        d >= 0             the contiguous part tp_rank of tp along dim d

    An expert-parallel target (Target.experts = (ep, ep_rank)) is first cut to its experts along
    dim 0, then along its tp_dim by its own Target.tp_split (moe_tp, moe_tp_rank).

    ValueError when the part is not the target's shape and dtype."""
    from bestiary.core.layers.self_attention import qkv_rank_slice
    from bestiary.core.sources.base import slice_dim

    tp, dim = config.mapping.tp_size, target.tp_dim
    if target.experts:
        ep, ep_rank = target.experts
        whole = whole[slice_dim(tuple(whole.shape), ep, 0, ep_rank)]  # the rank's E / ep experts
    tp, tp_rank = target.tp_split or (tp, tp_rank)
    if dim < 0 or tp == 1:
        part = whole
    elif dim == 0 and target.module_path.endswith("attention.qkv"):
        c = config
        part = qkv_rank_slice(whole, c.num_attention_heads, c.num_key_value_heads, c.head_size, tp, tp_rank)
    elif dim < whole.dim() and whole.shape[dim] == target.shape[dim] * tp:
        part = whole[slice_dim(tuple(whole.shape), tp, dim, tp_rank)]  # the loader's contiguous 1/tp part
    else:
        part = whole  # reported below
    if tuple(part.shape) != target.shape or part.dtype != target.dtype:
        raise ValueError(f"{target.key}: the tp 1 tensor {whole.dtype} {tuple(whole.shape)} gives rank "
                         f"{tp_rank} {part.dtype} {tuple(part.shape)} along dim {dim}, "
                         f"expected {target.dtype} {target.shape}")
    return part.contiguous()


def checkpoint_names(key: str, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A slot's {parameter name: tensor} -> {checkpoint key: tensor} for the weight `key` (ending in .weight)."""
    prefix = key.rpartition(".")[0]
    return {f"{prefix}.{name}": tensor for name, tensor in packed.items()}
