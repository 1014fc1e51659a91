"""The decoder layer that normalises each sublayer's output before its residual add (Exaone4, OLMo2):

    h   = x + post_layernorm(attention(x))
    out = h + post_feedforward_layernorm(mlp(h))

No norm on the sublayers' inputs; the model's final norm (ln_f) closes the stack.
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.kernels.metadata import AttentionMetadata


class OutputNormDecoderLayer(nn.Module):
    """Residual block with norms on the attention and MLP outputs: x [T, H] -> [T, H]."""

    def __init__(self, attention: nn.Module, post_layernorm: nn.Module, mlp: nn.Module,
                 post_feedforward_layernorm: nn.Module) -> None:
        super().__init__()
        self.attention = attention
        self.post_layernorm = post_layernorm
        self.mlp = mlp
        self.post_feedforward_layernorm = post_feedforward_layernorm

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        h = x + self.post_layernorm(self.attention(x, meta, k_pool, v_pool))
        return h + self.post_feedforward_layernorm(self.mlp(h, meta.lora))
