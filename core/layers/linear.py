"""Linear layers that know their tensor-parallel role.

Weights are (out_features, in_features), as in the checkpoint. A column-parallel layer
holds out_features / tp_size rows (tp_dim 0), a row-parallel one in_features / tp_size
columns (tp_dim 1) and all-reduces its output; a replicated one holds everything.

Quantized weights go in the same class: `quant` (a core.quant.slot.WeightOnlySlot,
installed by core.quant.apply from the config's `quantization` section) holds the packed
layout; `weight` is then the packed tensor and `weights_scaling_factor` (+ `zeros`) its
scales, under the checkpoint's names. A batched LoRA delta is added through the `lora`
argument of `forward`.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from bestiary.core.kernels.metadata import LoraDelta
from bestiary.core.layers import cpu_matmul


class Parallel(str, Enum):
    """How a linear layer's weight is split across tensor-parallel ranks."""

    COLUMN = "column"  # split out_features (weight dim 0, bias dim 0)
    ROW = "row"  # split in_features (weight dim 1; bias replicated, added after all-reduce)
    REPLICATED = "replicated"


class QuantSlot(Protocol):
    """What core.quant installs as `Linear.quant` (core.quant.slot.WeightOnlySlot, act_slot.ActQuantSlot):
    the packed weight's layout, its tp slicing and its matmul."""

    lq: Any  # the layer's core.quant.modes.LinearQuant (layers may not import core.quant)
    out_local: int  # N, K of this rank's weight
    in_local: int
    max_kernel_tokens: int | None  # CPU: steps of at most this many tokens run the weight-only kernels

    def tp_dim(self, name: str, weight_dim: int, is_column: bool) -> int: ...

    def prepare(self, linear: Linear) -> None: ...

    def matmul(self, linear: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def fuse(self, members: list[Linear]) -> Linear | None: ...

    def set_compute_dtype(self, linear: Linear, dtype: torch.dtype) -> None: ...


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
    `tp_group` is the process group of the all-reduce (None: the default world; a pipeline
    stage's own tp ranks under pipeline parallelism, set by DecoderLM.use_tp_group).
    """

    tp_group = None
    keep_float = False  # set by a layer whose Linear stays float under weight quantization (a MoE router)
    weight: nn.Parameter
    bias: nn.Parameter | None
    # the packed weight's tensors core.quant installs with `quant` (absent on a float layer)
    weights_scaling_factor: nn.Parameter
    zeros: nn.Parameter  # zero points (quantization.has_zero_point)
    in_perm: nn.Parameter  # W4A16_GPTQ: int32 [K_local] input permutation
    prequant_scaling_factor: nn.Parameter  # SmoothQuant / W4A8_AWQ [K_local]
    activation_scaling_factor: nn.Parameter  # activation-quantized: float32 [1]

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
        self.quant: QuantSlot | None = None  # packed weights + scales when quantized
        self._wt: torch.Tensor | None = None  # CPU float weights: W^T [in_local, out_local], weight is its view
        self._tiles: torch.Tensor | None = None  # CPU bf16 weights in row tiles [out_local, in_local]: weight's data

    def tp_dim(self, param_name: str) -> int:
        """Slicing dim of this layer's tensor `param_name` ("weight" / "bias" / scales)."""
        if self.quant is not None and param_name != "bias":
            weight_dim = tp_dim_of(self.parallel, is_weight=True)
            return self.quant.tp_dim(param_name, weight_dim, self.parallel == Parallel.COLUMN)
        return tp_dim_of(self.parallel, is_weight=param_name == "weight")

    def fuse(self) -> None:
        """After loading (DecoderLM.prepare_for_inference): repack quantized weights for the device;
        CPU float weights are held in row tiles or transposed (core.layers.cpu_matmul)."""
        if self.quant is not None:
            self.quant.prepare(self)
        elif self.weight.device.type != "cpu" or not self.weight.is_floating_point() or self.held():
            return
        elif cpu_matmul.tiles_fit(self.weight):
            self._tiles = cpu_matmul.hold_tiled(self)
        else:
            self._wt = cpu_matmul.hold_transposed(self.weight)

    def held(self) -> bool:
        """True when the weight is already held for the CPU kernels (row tiles or W^T)."""
        return self._wt is not None or self._tiles is not None

    def forward(self, x: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:
        """x [T, in_local] -> y [T, out_local] (row-parallel: all-reduced [T, out])."""
        bias = None if self.parallel == Parallel.ROW else self.bias
        if self.quant is not None:
            y = self.quant.matmul(self, x, bias)
        elif self._tiles is not None and x.device.type == "cpu":
            y = cpu_matmul.matmul_tiled(x, self._tiles, bias)
        elif self._wt is not None and x.device.type == "cpu":
            y = cpu_matmul.matmul_t(x, self._wt, bias)
        else:
            y = F.linear(x, self.weight, bias)
        if lora is not None:
            delta = lora(self, x)
            if delta is not None:
                y = y + delta
        if self.parallel == Parallel.ROW:
            if self.tp_size > 1:
                torch.distributed.all_reduce(y, group=self.tp_group)
            if self.bias is not None:
                y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"parallel={self.parallel.value}, tp={self.tp_rank}/{self.tp_size}"
            + (f", quant={self.quant.lq.algo}" if self.quant is not None else "")
        )
