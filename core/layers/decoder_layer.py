"""The pre-norm decoder layer shared by LLaMA-style architectures.

    h   = x + attention(input_layernorm(x))
    out = h + mlp(post_layernorm(h))
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.layers.attention import AttentionMetadata


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
        h = x + self.attention(self.input_layernorm(x), meta, k_pool, v_pool)
        return h + self.mlp(self.post_layernorm(h), meta.lora)
