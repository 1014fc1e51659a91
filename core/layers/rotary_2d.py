"""2D rotary position embedding (GLM / ChatGLM v1 `position_encoding_2d`).

Each token carries two position ids: p (its position, frozen at the [g]MASK slot for the
generated span) and b (its block position: 0 in the context, 1, 2, ... in the span).
A head of D dims is split in two halves of D/2; with the neox-style rotation of
`Rotary` over r = D/2 dims (theta_i = base^(-2i/r), pairs (i, i + r/2)):

    x'[:D/2] = rope(x[:D/2], p)
    x'[D/2:] = rope(x[D/2:], b)
"""

from __future__ import annotations

import torch
from torch import nn

from bestiary.core.format.errors import ConfigError
from bestiary.core.layers.rotary import Rotary


class Rotary2D(nn.Module):
    """Applies 2D RoPE in place to heads [T, n, head_dim] given positions [2, T].

    Duck-types `Rotary` (`cos_sin`, `step_cos_sin` + `rotate`) so `SelfAttention` takes either.
    """

    def __init__(self, head_dim: int, base: float, max_positions: int) -> None:
        super().__init__()
        if head_dim % 4:
            raise ConfigError(f"2D rotary needs a head size divisible by 4, got {head_dim}")
        self.half_dim = head_dim // 2  # not `half`: nn.Module.half() casts a module to float16
        self.inner = Rotary(self.half_dim, self.half_dim, base, None, max_positions, style="neox")

    def step_cos_sin(self, meta, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin(meta.positions)`, computed once per step for every layer."""
        key = ("rotary2d", self.half_dim, self.inner.base, dtype)
        return meta.step_value(key, lambda: self.cos_sin(meta.positions, dtype))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [2, T] -> cos, sin [2, T, 1, head_dim/4] (index 0: positions, 1: block positions)."""
        if positions.dim() != 2 or positions.shape[0] != 2:
            raise ValueError(f"2D rotary expects positions of shape [2, T], got {tuple(positions.shape)}")
        c0, s0 = self.inner.cos_sin(positions[0], dtype)
        c1, s1 = self.inner.cos_sin(positions[1], dtype)
        return torch.stack([c0, c1]), torch.stack([s0, s1])

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [T, n, head_dim] in place: first half by positions, second half by block positions."""
        self.inner.rotate(x[..., : self.half_dim], cos[0], sin[0])
        self.inner.rotate(x[..., self.half_dim :], cos[1], sin[1])
