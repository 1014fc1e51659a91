"""Input statistics of every Linear, measured while a float model runs over calibration tokens.

For a Linear y = x W^T (W [N, K]) and calibration inputs x_t [K], t = 1..T:

    absmax[k] = max_t |x_t[k]|          (the per-channel range AWQ and SmoothQuant scale by)
    amax      = max_k absmax[k]         (per-tensor range: FP8 / int8 activation scales)
    hessian   = sum_t x_t x_t^T  [K, K] (the layer's proxy Hessian: the output error of a weight
                                         error dW is sum_t |dW x_t|^2 = trace(dW H dW^T))

core.convert.calibration collects them (`collect_linear_inputs`); the quantizers (core.quant.gptq,
awq, act_slot) read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LinearInputStats:
    """What the inputs of one Linear looked like over the calibration tokens (module docstring)."""

    absmax: torch.Tensor  # float32 [K]
    amax: float
    hessian: torch.Tensor | None  # float32 [K, K] = sum_t x_t x_t^T, or None when not collected
    tokens: int


class _Accumulator:
    """Running absmax / hessian of one Linear's inputs."""

    def __init__(self, hessian: bool) -> None:
        self.with_hessian = hessian
        self.absmax: torch.Tensor | None = None
        self.hessian: torch.Tensor | None = None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).float()  # [T, K]
        amax = x2.abs().amax(dim=0)  # [K]
        self.absmax = amax if self.absmax is None else torch.maximum(self.absmax, amax)
        if self.with_hessian:
            xtx = x2.t() @ x2  # [K, K]
            self.hessian = xtx if self.hessian is None else self.hessian.add_(xtx)
        self.tokens += x2.shape[0]

    def stats(self) -> LinearInputStats:
        assert self.absmax is not None
        return LinearInputStats(self.absmax, float(self.absmax.max()), self.hessian, self.tokens)
