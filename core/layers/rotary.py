"""Rotary position embedding (RoPE): inverse frequencies, scaling, and its application.

For position p and pair i of a head (i < rot_dim/2), with theta_i = base^(-2i/rot_dim):
    x'_a = x_a cos(p theta_i) - x_b sin(p theta_i)
    x'_b = x_b cos(p theta_i) + x_a sin(p theta_i)
where (a, b) = (i, i + rot_dim/2) in neox style (half split) and (2i, 2i+1) in gptj
style (interleaved). Dims past rot_dim are left unchanged (partial rotary).
Scaling: linear, llama3 and yarn change theta (rope_inv_freq), yarn also scales cos / sin
(core.layers.yarn); longrope (Phi-3) switches between two sets of thetas by each sequence's length and
scales cos / sin (core.layers.longrope).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from bestiary.core.format.errors import ConfigError
from bestiary.core.kernels import dispatch
from bestiary.core.layers.longrope import LongRope
from bestiary.core.layers.yarn import yarn_attention_factor, yarn_inv_freq


def rope_inv_freq(rot_dim: int, base: float, scaling: dict | None, max_positions: int = 2048) -> torch.Tensor:
    """theta_i [rot_dim/2] in float64->float32, with HF's linear / llama3 / yarn scaling applied
    (`max_positions`: the model's max_position_embeddings, which yarn's defaults read)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "yarn":
        return yarn_inv_freq(inv_freq, rot_dim, base, scaling, max_positions)
    raise ConfigError(f"rotary_scaling: unsupported rope_type {kind!r}; expected linear, llama3 or yarn")


def rope_attention_factor(scaling: dict | None, max_positions: int) -> float:
    """The scale of cos / sin: yarn's attention factor (core.layers.yarn), else 1."""
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        return yarn_attention_factor(scaling, max_positions)
    return 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (long wavelengths divided by factor, smooth band between)."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# cos / sin tables by (rot_dim, base, scaling, max_positions, device), held while a Rotary holds them
_TABLES: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


class Rotary(nn.Module):
    """Applies RoPE in place to q and k heads packed as [T, n_heads, head_dim]."""

    def __init__(
        self, head_dim: int, rot_dim: int, base: float, scaling: dict | None, max_positions: int, style: str = "neox"
    ) -> None:
        super().__init__()
        if style not in ("neox", "gptj"):
            raise ConfigError(f"rotary style {style!r}: expected neox or gptj")
        self.head_dim, self.rot_dim, self.style = head_dim, rot_dim, style
        self.base, self.scaling = base, scaling
        self.max_positions = max_positions
        self._cos_sin: torch.Tensor | None = None  # [max_pos, rot_dim] = cat(cos, sin), float32
        # rope_type longrope: two frequency sets switched by sequence length (core.layers.longrope)
        self.longrope = LongRope.of(rot_dim, base, scaling, max_positions)

    def _table(self, device: torch.device, needed: int) -> torch.Tensor:
        """cat(cos, sin) rows [P >= needed, rot_dim] on `device`: this module's, else the one another Rotary of
        the same parameters holds (every layer has its own module; one table of max_positions rows each cost
        30 x 2 MiB on SmolLM2, 32 x 64 MiB on a 131k-position Llama 3), else made now."""
        table = self._cos_sin
        if table is None or table.device != device or table.shape[0] < needed:
            size = max(needed, self.max_positions)
            key = (self.rot_dim, self.base, repr(self.scaling), self.max_positions, str(device))
            table = _TABLES.get(key)
            if table is None or table.shape[0] < size:
                table = _TABLES[key] = self._make_table(size).to(device)
            self._cos_sin = table
        return table

    def _make_table(self, size: int) -> torch.Tensor:
        """cat(cos, sin) [size, rot_dim] float32 for positions 0..size-1 (times yarn's attention factor)."""
        if self.longrope is not None:  # short rows below its switch length, long rows from it
            return self.longrope.table(size)
        inv_freq = rope_inv_freq(self.rot_dim, self.base, self.scaling, self.max_positions)
        freqs = torch.outer(torch.arange(size, dtype=torch.float32), inv_freq)  # [P, rot/2]
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, rot]
        scale = rope_attention_factor(self.scaling, self.max_positions)
        return table * scale if scale != 1.0 else table

    def reserve(self, device: torch.device, positions: int) -> None:
        """Build the cos/sin table on `device` for positions 0..positions-1 now (before a graph capture)."""
        self._table(device, positions)

    def step_cos_sin(self, meta, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin(meta.positions)`, computed once per step for every layer with the same rotary."""
        key = ("rotary", self.rot_dim, self.base, repr(self.scaling), dtype)
        if self.longrope is not None:  # a prefill longer than the switch length reads long rows below it
            longrope = self.longrope
            return meta.step_value(key, lambda: longrope.step(*self.cos_sin(meta.positions, dtype), meta))
        return meta.step_value(key, lambda: self.cos_sin(meta.positions, dtype))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot_dim/2] for `positions` [T].

        While a CUDA graph is captured (core.runtime.cuda_graph) the table is the one `reserve` sized:
        reading max(positions) would sync the device, and a table grown later would leave the graph
        reading freed memory."""
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            table = self._cos_sin
            if table is None or table.device != positions.device:
                raise RuntimeError("rotary: the cos/sin table was not reserved on this device before the capture")
        else:
            table = self._table(positions.device, int(positions.max()) + 1 if positions.numel() else 1)
        cs = table.index_select(0, positions).to(dtype).unsqueeze(1)
        half = self.rot_dim // 2
        return cs[..., :half], cs[..., half:]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [T, n, head_dim] in place with cos/sin [T, 1, rot_dim/2] (kernels.rotary)."""
        dispatch.apply_rotary(x, cos, sin, self.rot_dim, self.style)
