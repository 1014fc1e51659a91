"""The decoder layer with a norm before and after each sublayer (Gemma 2 / Gemma 3's "sandwich"):

    h   = x + post_layernorm(attention(input_layernorm(x)))
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

The pre-norm layer (core.layers.decoder_layer) plus the output norms of core.layers.output_norm_decoder_layer.
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.layers.decoder_layer import add_and_norm


class SandwichNormDecoderLayer(nn.Module):
    """Residual block with norms on each sublayer's input and output: x [T, H] -> [T, H]."""

    def __init__(self, input_layernorm: nn.Module, attention: nn.Module, post_layernorm: nn.Module,
                 pre_feedforward_layernorm: nn.Module, mlp: nn.Module, post_feedforward_layernorm: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.attention = attention
        self.post_layernorm = post_layernorm
        self.pre_feedforward_layernorm = pre_feedforward_layernorm
        self.mlp = mlp
        self.post_feedforward_layernorm = post_feedforward_layernorm

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        a = self.post_layernorm(self.attention(self.input_layernorm(x), meta, k_pool, v_pool))  # [T, H]
        y, h = add_and_norm(self.pre_feedforward_layernorm, a, x)  # h = x + a, y = pre-MLP norm(h)
        return h + self.post_feedforward_layernorm(self.mlp(y, meta.lora))
