"""The scaled-residual decoder layer (GLM-130B's DeepNorm-style block; ChatGLM v1): the residual
is taken after the norm and scaled by alpha (sqrt(2 L) for L layers in ChatGLM-6B).

    a = input_layernorm(x);  h = a * alpha + attention(a)
    m = post_layernorm(h);   out = m * alpha + mlp(m)
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.kernels.metadata import AttentionMetadata


class ScaledResidualLayer(nn.Module):
    """Residual block with post-norm, alpha-scaled residuals; same module names as PreNormDecoderLayer."""

    def __init__(self, input_layernorm: nn.Module, attention: nn.Module, post_layernorm: nn.Module, mlp: nn.Module,
                 alpha: float) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.attention = attention
        self.post_layernorm = post_layernorm
        self.mlp = mlp
        self.alpha = alpha

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        a = self.input_layernorm(x)
        h = torch.add(self.attention(a, meta, k_pool, v_pool), a, alpha=self.alpha)
        m = self.post_layernorm(h)
        return torch.add(self.mlp(m, meta.lora), m, alpha=self.alpha)
