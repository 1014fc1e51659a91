"""Normalisation layers (replicated across tensor-parallel ranks).

The math lives in bestiary.core.kernels.norms (Triton kernel + torch reference), picked by
bestiary.core.kernels.dispatch.
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.kernels import dispatch


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (offset + w), computed in float32, returned in x's dtype.

    offset 0: LLaMA's norm; offset 1: Gemma's, whose checkpoints store w - 1 (HF Gemma2RMSNorm: the
    scale 1 + w is formed in float32, so it is never rounded to a bf16 / fp16 weight dtype here either)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32, device=None,
                 offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def scale(self) -> torch.Tensor:
        """The per-channel scale [H]: the weight itself, or offset + w in float32."""
        return self.weight if not self.offset else self.weight.float() + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return dispatch.rms_norm(x, self.scale(), self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass on the Triton path: [T, H] each."""
        return dispatch.add_rms_norm(x, residual, self.scale(), self.eps)


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * w + b (b optional), computed in float32."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, bias: bool = True, dtype: torch.dtype = torch.float32, device=None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return dispatch.layer_norm(x, self.weight, self.bias, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass on the Triton path: [T, H] each."""
        return dispatch.add_layer_norm(x, residual, self.weight, self.bias, self.eps)
