"""Fusing quantized Linears that read the same input into one matmul (CPU decode speed).

A gated MLP's fc (gate_proj) and gate (up_proj) both multiply the same x; stacked along the
out dim their packed weights form one layer of N_fc + N_gate rows:

    int8:  weight [N1 + N2, K] = [W1; W2],  scales [N1 + N2] = [s1; s2]
    int4:  packed weight, scales and zeros stacked the same way (rows are independent)

so [y1, y2] = x [W1; W2]^T is exact. The members' tensors become views of the fused ones
(nothing is held twice); they still serve the LoRA path and the state dict.
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.format.packing import QUAD_ROWS, TILE_ROWS, cpu_int4_block_n
from bestiary.core.layers.linear import Linear
from bestiary.core.quant.slot import WeightOnlySlot

STACKED = ("weight", "weights_scaling_factor", "zeros")


def _fusable_slots(members: list[Linear]) -> list[WeightOnlySlot] | None:
    """The members' slots when their packed weights can be stacked (same layout, checkpoint layout, no
    bias or in_perm, CPU, rows aligned to the kernels' blocks), else None."""
    first = members[0].quant
    if not isinstance(first, WeightOnlySlot) or first.layout != "checkpoint":
        return None
    slots = []
    for m in members:
        slot = m.quant
        if type(slot) is not WeightOnlySlot or slot.lq != first.lq or slot.in_local != first.in_local:
            return None
        if m.bias is not None or hasattr(m, "in_perm") or m.weight.device.type != "cpu":
            return None
        if first.lq.bits == 4 and slot.out_local % cpu_int4_block_n() and not slot.runs_compiled(m):
            return None  # the aten CPU int4 layout: a member's rows must start on one of its blocks
        if first.lq.bits == 8 and slot.out_local % TILE_ROWS and slot.runs_compiled(m):
            return None  # the compiled int8 tiles: a member's rows must be whole tiles
        if first.lq.bits == 4 and slot.out_local % QUAD_ROWS and slot.runs_compiled(m):
            return None  # the compiled int4 kernels' quads (8-row tiles) and dot layout (4-row tiles): the same
        slots.append(slot)
    return slots


def fuse_quantized(members: list[Linear]) -> Linear | None:
    """One Linear computing [x W1^T, x W2^T, ...] from members' packed weights (before their
    prepare()), or None when they cannot be fused (different layouts, biases, in_perm, ...)."""
    slots = _fusable_slots(members)
    if slots is None:
        return None
    n = sum(s.out_local for s in slots)
    fused = Linear(slots[0].in_local, n, dtype=members[0].weights_scaling_factor.dtype, device="meta")
    fused.name = "+".join(m.name for m in members)
    slot = WeightOnlySlot.install(fused, slots[0].lq)
    for name in STACKED:
        if hasattr(members[0], name):
            setattr(fused, name, nn.Parameter(torch.cat([getattr(m, name).data for m in members]), requires_grad=False))
    slot.prepare(fused)
    _make_views(fused, slot, members, slots)
    return fused


def _make_views(fused: Linear, slot: WeightOnlySlot, members: list[Linear], slots: list[WeightOnlySlot]) -> None:
    """Point each member's packed tensors at its rows of the fused layer's (prepared) tensors, and
    its slot's layout at the fused `slot`'s."""
    start = 0
    for m, member_slot in zip(members, slots):
        rows = slice(start, start + member_slot.out_local)
        for name in STACKED:
            if hasattr(m, name):
                getattr(m, name).data = getattr(fused, name).data[rows]
        member_slot.layout, member_slot.k_pad = slot.layout, slot.k_pad
        start = rows.stop
