"""The parallel-attention decoder layer (Falcon, GPT-J, GPT-NeoX with use_parallel_residual).

Attention and MLP both read the layer input and their outputs are summed:

    out = x + attention(input_layernorm(x)) + mlp(mlp_layernorm(x))

With one norm (Falcon-7B, GPT-J) `mlp_layernorm` is absent and the MLP reads
input_layernorm(x) too; with two (Falcon-40B/180B's ln_attn, ln_mlp) each branch has its own.
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.kernels.metadata import AttentionMetadata


class ParallelDecoderLayer(nn.Module):
    """x + attention(ln_a(x)) + mlp(ln_m(x)), ln_m = ln_a when `mlp_layernorm` is None."""

    def __init__(
        self, input_layernorm: nn.Module, attention: nn.Module, mlp: nn.Module,
        mlp_layernorm: nn.Module | None = None,
    ):
        super().__init__()
        self.input_layernorm = input_layernorm
        self.attention = attention
        self.mlp = mlp
        if mlp_layernorm is not None:
            self.mlp_layernorm = mlp_layernorm
        self.two_norms = mlp_layernorm is not None

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        a = self.input_layernorm(x)  # [T, H]
        m = self.mlp_layernorm(x) if self.two_norms else a
        return x + self.attention(a, meta, k_pool, v_pool) + self.mlp(m, meta.lora)
