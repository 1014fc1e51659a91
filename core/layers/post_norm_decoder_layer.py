"""The post-norm decoder layer (the original Transformer's; OPT-350m with do_layer_norm_before false).

    h   = input_layernorm(x + attention(x))
    out = post_layernorm(h + mlp(h))
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.layers.decoder_layer import add_and_norm


class PostNormDecoderLayer(nn.Module):
    """Residual block that normalises after each residual add; same module names as PreNormDecoderLayer."""

    def __init__(
        self, input_layernorm: nn.Module, attention: nn.Module, post_layernorm: nn.Module, mlp: nn.Module
    ):
        super().__init__()
        self.input_layernorm = input_layernorm
        self.attention = attention
        self.post_layernorm = post_layernorm
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        h, _ = add_and_norm(self.input_layernorm, self.attention(x, meta, k_pool, v_pool), x)  # norm(x + attn)
        out, _ = add_and_norm(self.post_layernorm, self.mlp(h, meta.lora), h)  # norm(h + mlp)
        return out
