"""Linear layers that know their tensor-parallel role.

Weights are (out_features, in_features), as in the checkpoint. A column-parallel layer
holds out_features / tp_size rows (tp_dim 0), a row-parallel one in_features / tp_size
columns (tp_dim 1) and all-reduces its output; a replicated one holds everything.

Quantized weights go in the same class: `quant` names the packed layout and the
`weights_scaling_factor` buffer holds its scales (see `QuantSlot`). A batched LoRA delta
is added through the `lora` argument of `forward`.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Parallel(str, Enum):
    """How a linear layer's weight is split across tensor-parallel ranks."""

    COLUMN = "column"  # split out_features (weight dim 0, bias dim 0)
    ROW = "row"  # split in_features (weight dim 1; bias replicated, added after all-reduce)
    REPLICATED = "replicated"


class LoraDelta(Protocol):
    """Per-step batched LoRA: returns the delta y_lora [T, out] for input x [T, in] of `module`."""

    def __call__(self, module: "Linear", x: torch.Tensor) -> torch.Tensor | None: ...


def tp_dim_of(parallel: Parallel, is_weight: bool) -> int:
    """The dim a tensor of a layer with this parallel kind is sliced along (-1: replicated)."""
    if parallel == Parallel.COLUMN:
        return 0
    if parallel == Parallel.ROW and is_weight:
        return 1
    return -1


class Linear(nn.Module):
    """y = x W^T + b, with W [out_local, in_local] for this rank.

    tp_rank/tp_size say which slice this rank holds; `parallel` says along which dim.
    `name` is the canonical module path (e.g. transformer.layers.0.attention.qkv), set
    by the model after construction so LoRA and quantization can select modules.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        parallel: Parallel = Parallel.REPLICATED,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.parallel = Parallel(parallel)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_features, self.out_features = in_features, out_features
        out_local = out_features // tp_size if self.parallel == Parallel.COLUMN else out_features
        in_local = in_features // tp_size if self.parallel == Parallel.ROW else in_features
        for full, local, what in ((out_features, out_local, "out"), (in_features, in_local, "in")):
            if local * (tp_size if full != local else 1) != full:
                raise ValueError(f"{what}_features {full} is not divisible by tp_size {tp_size}")
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_local, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.name = ""

    def tp_dim(self, param_name: str) -> int:
        """Slicing dim of this layer's tensor `param_name` ("weight" / "bias" / scales)."""
        return tp_dim_of(self.parallel, is_weight=param_name == "weight")

    def forward(self, x: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:
        """x [T, in_local] -> y [T, out_local] (row-parallel: all-reduced [T, out])."""
        y = F.linear(x, self.weight, None if self.parallel == Parallel.ROW else self.bias)
        if lora is not None:
            delta = lora(self, x)
            if delta is not None:
                y = y + delta
        if self.parallel == Parallel.ROW:
            if self.tp_size > 1:
                torch.distributed.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"parallel={self.parallel.value}, tp={self.tp_rank}/{self.tp_size}"
        )
