"""The pre-norm decoder layer shared by LLaMA-style architectures.

    h   = x + attention(input_layernorm(x))
    out = h + mlp(post_layernorm(h))
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.kernels.metadata import AttentionMetadata


def add_and_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) [T, H] each: the norm's fused kernel when it has one
    (core RMSNorm / LayerNorm: one Triton kernel on CUDA), else the add then the norm."""
    fused = getattr(norm, "add_and_norm", None)
    if fused is not None:
        return fused(x, residual)
    h = x + residual
    return norm(h), h


class PreNormDecoderLayer(nn.Module):
    """Residual pre-norm block over any attention / mlp / norm modules with the layer interface."""

    def __init__(self, input_layernorm: nn.Module, attention: nn.Module, post_layernorm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = input_layernorm
        self.attention = attention
        self.post_layernorm = post_layernorm
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        a = self.attention(self.input_layernorm(x), meta, k_pool, v_pool)
        y, h = add_and_norm(self.post_layernorm, a, x)  # h = x + a, y = norm(h)
        return h + self.mlp(y, meta.lora)
