"""YaRN RoPE scaling (transformers' rope_type "yarn": DeepSeek-V2 / V3, gpt-oss, Qwen long-context, GGUF's
`rope.scaling.type yarn`): per-pair frequencies blended between extrapolated and interpolated ones, and
an attention factor on cos / sin.

For pair i of d/2 (d = rot_dim), theta_i = base^(-2i/d), factor s, o = original_max_position_embeddings
(default: max_position_embeddings), beta_fast b_f (32) and beta_slow b_s (1):

    corr(r)  = d ln(o / (2 pi r)) / (2 ln base)            the pair that turns r times over o positions
    lo, hi   = max(corr(b_f), 0), min(corr(b_s), d - 1)     floored / ceiled unless truncate is false
    ramp_i   = clamp((i - lo) / (hi - lo), 0, 1)             (hi += 0.001 when lo == hi)
    theta'_i = theta_i / s * ramp_i + theta_i * (1 - ramp_i)
    cos, sin times a = attention_factor, else m(s, mscale) / m(s, mscale_all_dim) when both are set,
                       else m(s, 1), with m(s, c) = 0.1 c ln(s) + 1 for s > 1, else 1

so fast-turning pairs (ramp 0) keep their frequency and slow ones (ramp 1) are interpolated by s; q.k
is scaled by a^2. A missing `factor` is max_position_embeddings / o (transformers' rule). DeepSeek's
attention also multiplies its softmax scale by m(s, mscale_all_dim)^2: that is the family's
(`yarn_mscale`), not the rotary's.
"""

from __future__ import annotations

import math

import torch

from bestiary.core.format.errors import ConfigError

KIND = "yarn"


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """m(s, c) = 0.1 c ln(s) + 1 for s > 1, else 1."""
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def yarn_factor(scaling: dict, max_positions: int) -> float:
    """s: the dict's `factor`, else max_position_embeddings / original_max_position_embeddings."""
    factor = scaling.get("factor")
    return float(factor) if factor is not None else max_positions / original_positions(scaling, max_positions)


def original_positions(scaling: dict, max_positions: int) -> int:
    """o: `original_max_position_embeddings`, else the model's max_position_embeddings (transformers' default)."""
    return int(scaling.get("original_max_position_embeddings") or max_positions)


def yarn_attention_factor(scaling: dict, max_positions: int) -> float:
    """a, the cos / sin scale (module docstring)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    s = yarn_factor(scaling, max_positions)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(s, float(mscale)) / yarn_mscale(s, float(mscale_all_dim))
    return yarn_mscale(s)


def _correction_dim(rotations: float, rot_dim: int, base: float, original: int) -> float:
    """corr(r) = d ln(o / (2 pi r)) / (2 ln base)."""
    return rot_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(inv_freq: torch.Tensor, rot_dim: int, base: float, scaling: dict, max_positions: int) -> torch.Tensor:
    """theta'_i [rot_dim/2] from the unscaled theta_i `inv_freq` [rot_dim/2] (module docstring)."""
    if base <= 1:  # corr(r) divides by ln(base)
        raise ConfigError(f"rotary_scaling: yarn needs rope_theta > 1 (got {base:g})")
    s, original = yarn_factor(scaling, max_positions), original_positions(scaling, max_positions)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
    lo, hi = _correction_dim(fast, rot_dim, base, original), _correction_dim(slow, rot_dim, base, original)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rot_dim - 1)
    if lo == hi:
        hi += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)  # [d/2]
    return inv_freq / s * ramp + inv_freq * (1 - ramp)
