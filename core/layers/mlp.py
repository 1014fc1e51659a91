"""Feed-forward blocks: gated (SwiGLU / GeGLU) and plain two-layer MLPs.

Checkpoint names: mlp.fc (gate_proj), mlp.gate (up_proj), mlp.proj (down_proj).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bestiary.core.format import packing
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.activations_ref import activation
from bestiary.core.kernels.cpu import malloc
from bestiary.core.kernels.metadata import LoraDelta
from bestiary.core.layers import cpu_matmul
from bestiary.core.layers.linear import Linear, Parallel


def heap_chunks(x: torch.Tensor, width: int) -> int:
    """How many pieces to cut x's rows (tokens) into so that a [rows, width] activation in x's dtype stays
    under glibc's largest mmap threshold (core.kernels.cpu.malloc.MMAP_BYTES, 32 MiB); 1 off the CPU.

    A block at or above it is mapped afresh and returned on free, so every layer of a long prefill
    faulted its [T, 2I] activation in again: ~12,000 page faults a layer for SmolLM2's 50 MB at 8,192
    tokens in bfloat16 (measured: 480 k faults in the 64-request mixed workload, ~110 k with pieces)."""
    if x.device.type != "cpu" or x.dim() != 2:
        return 1
    row = width * x.element_size()
    return -(-x.shape[0] * row // (malloc.MMAP_BYTES - 4096))  # ceil: each piece under the threshold


class GatedMLP(nn.Module):
    """y = proj(act(fc(x)) * gate(x)): fc = gate_proj, gate = up_proj, proj = down_proj.

    After loading, `fuse()` packs fc and gate into one [2 * I_local, H] matmul.
    """

    def __init__(self, hidden: int, inter: int, act: str, bias: bool, tp_rank: int, tp_size: int, dtype, device=None):
        super().__init__()
        col = dict(bias=bias, parallel=Parallel.COLUMN, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
        self.fc = Linear(hidden, inter, **col)
        self.gate = Linear(hidden, inter, **col)
        self.proj = Linear(inter, hidden, bias=bias, parallel=Parallel.ROW, tp_rank=tp_rank, tp_size=tp_size,
                           dtype=dtype, device=device)
        self.act = activation(act)
        self.act_name = act
        self._fused: torch.Tensor | None = None  # [2 I_local, H]
        self._fused_t: torch.Tensor | None = None  # CPU: [H, 2 I_local] contiguous, _fused its view
        self._fused_tiles: torch.Tensor | None = None  # CPU bf16: [2 I_local, H] in row tiles (cpu_matmul)
        self._fused_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """Pack fc and gate weights into one [2 * I_local, H] tensor (inference speed)."""
        slot = self.fc.quant or self.gate.quant
        if slot is not None:
            # quantized: one layer over both packed weights (not a submodule: the state dict is unchanged)
            self.__dict__["_fused_q"] = slot.fuse([self.fc, self.gate])
            return
        inter = self.fc.weight.shape[0]
        self._fused = torch.cat([self.fc.weight, self.gate.weight])
        # fc/gate become views of the fused tensor: no second copy of the weights.
        if inter % 8 == 0 and cpu_matmul.tiles_fit(self._fused):  # fc's tiles, then gate's
            self._fused_tiles = tiles = packing.pack_float_tiled(self._fused, in_place=True)  # the cat's own memory
            self._fused = None
            self.fc._tiles = cpu_matmul.hold_tiled(self.fc, tiles=tiles[:inter])
            self.gate._tiles = cpu_matmul.hold_tiled(self.gate, tiles=tiles[inter:])
        elif self._fused.device.type == "cpu":
            self._fused_t = self._fused.t().contiguous()  # [H, 2I]: core.layers.cpu_matmul
            self._fused = self._fused_t.t()
        if self._fused is not None:
            self.fc.weight.data, self.gate.weight.data = self._fused[:inter], self._fused[inter:]
        if self.fc.bias is not None and self.gate.bias is not None:  # both or neither (`bias`)
            self._fused_bias = torch.cat([self.fc.bias, self.gate.bias])
            self.fc.bias.data, self.gate.bias.data = self._fused_bias[:inter], self._fused_bias[inter:]

    def forward(self, x: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. A LoRA delta on fc / gate is added to their fused output [T, 2I].
        On the CPU, a long prefill runs in pieces of tokens (heap_chunks: the [rows, 2I] activation under
        glibc's mmap threshold); the rows are independent, so the output is the same."""
        pieces = heap_chunks(x, 2 * self.fc.out_features // self.fc.tp_size) if lora is None else 1
        if pieces > 1:
            return torch.cat([self._forward(part, None) for part in x.chunk(pieces)])  # [T, H]
        return self._forward(x, lora)

    def _forward(self, x: torch.Tensor, lora: LoraDelta | None) -> torch.Tensor:
        fused_q = self.__dict__.get("_fused_q")
        tiles = self._fused_tiles if x.device.type == "cpu" else None
        if fused_q is None and self._fused is None and tiles is None:
            h = dispatch.act_and_mul(self.fc(x, lora), self.gate(x, lora), self.act_name)
            return self.proj(h, lora)
        if fused_q is not None:
            fg = fused_q(x)  # [T, 2I]
        elif tiles is not None:
            fg = cpu_matmul.matmul_tiled(x, tiles, self._fused_bias)  # [T, 2I]
        elif self._fused_t is not None and x.device.type == "cpu":
            fg = cpu_matmul.matmul_t(x, self._fused_t, self._fused_bias)  # [T, 2I]
        else:
            assert self._fused is not None  # held whenever neither fused_q nor tiles is (returned above)
            fg = F.linear(x, self._fused, self._fused_bias)  # [T, 2I]
        delta = lora.concat((self.fc, self.gate), x) if lora is not None else None
        if delta is not None:
            fg = fg + delta
        return self.proj(dispatch.gated_act(fg, self.act_name), lora)


class MLP(nn.Module):
    """y = proj(act(fc(x))) (OPT, Falcon, ChatGLM v1)."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool, tp_rank: int, tp_size: int, dtype, device=None):
        super().__init__()
        self.fc = Linear(hidden, inter, bias=bias, parallel=Parallel.COLUMN, tp_rank=tp_rank, tp_size=tp_size,
                         dtype=dtype, device=device)
        self.proj = Linear(inter, hidden, bias=bias, parallel=Parallel.ROW, tp_rank=tp_rank, tp_size=tp_size,
                           dtype=dtype, device=device)
        self.act = activation(act)
        self.act_name = act

    def forward(self, x: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.proj(dispatch.activation(self.fc(x, lora), self.act_name), lora)
