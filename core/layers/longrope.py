"""LongRoPE (transformers' rope_type "longrope": Phi-3 128k, Phi-3.5, Phi-4-mini): two sets of
per-pair frequency divisors switched by the sequence length, and an attention scaling.

For pair i of rot_dim/2, theta_i = base^(-2i/rot_dim) and o = original_max_position_embeddings:

    short:  theta_i / short_factor[i]    a sequence of at most o tokens
    long:   theta_i / long_factor[i]     a longer one
    cos, sin (both sets) times a = attention_factor, else sqrt(1 + ln(s) / ln(o)) when s > 1, else 1,
        where s = factor, else max_position_embeddings / o    (so q.k is scaled by a^2; v is not)

Which set a token uses: transformers' Phi3 rotary (modeling_rope_utils.longrope_frequency_update)
takes long for a whole forward whose max(position_ids) + 1 > o. bestiary decides per sequence of a
step: its length after the step, L = context_len + seq_len; every new token of that sequence uses
long when L > o, short otherwise. So a prompt longer than o is long from its first token, one that
stays within o is short throughout, and (as in transformers' forward with a cache) a decode token at
position p uses long exactly when p >= o. K/V already in the cache keep the set they were written
with, as in transformers' forward over a cache: a sequence stepped past o keeps its first o tokens'
short-rotated keys. transformers' `generate` instead drops its cache once, at the first step past o,
and recomputes every token with long; bestiary's executor does the same (Executor._recomputes: the
sequence is computed again in that step, for a lone sample that fits the step's token budget), so
`LLM.generate` gives transformers' tokens (tests/models/test_phi3_longrope.py shows both behaviours).

Tables (rows of cat(cos, sin) * a, [P, rot_dim]): `table(P)` holds short rows for p < o and long rows
for p >= o, which is exactly what every decode token reads (L = p + 1), so the compiled CPU decode
plan and CUDA graphs index it by position like any rotary table; `long_prefix` [o, rot_dim] holds the
long rows below o, read by a prefill of a sequence longer than o (`select`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bestiary.core.format.errors import ConfigError

KIND = "longrope"


@dataclass(frozen=True)
class LongRope:
    """The two sets of per-pair divisors (rot_dim/2 each), theta's base, the switch length o and the
    cos/sin scale a. Tensors are made when a table is (on the CPU: models are built on the meta device)."""

    short: tuple[float, ...]
    long: tuple[float, ...]
    base: float
    original: int
    attention_factor: float

    @classmethod
    def of(cls, rot_dim: int, base: float, scaling: dict[str, Any] | None, max_positions: int) -> LongRope | None:
        """The LongRope of a rope scaling dict of kind longrope (None for any other kind); a factor list
        whose length is not rot_dim/2, or a missing field, is a one-line ConfigError."""
        if not scaling or scaling.get("rope_type", scaling.get("type")) != KIND:
            return None
        original = scaling.get("original_max_position_embeddings")
        if not original:
            raise ConfigError("rotary_scaling: longrope needs original_max_position_embeddings")
        sets = []
        for name in ("short_factor", "long_factor"):
            factors = scaling.get(name)
            if not isinstance(factors, list) or len(factors) != rot_dim // 2:
                got = len(factors) if isinstance(factors, list) else factors
                raise ConfigError(f"rotary_scaling: longrope {name} must be a list of rot_dim/2 = {rot_dim // 2} "
                                  f"numbers (got {got})")
            sets.append(tuple(float(f) for f in factors))
        return cls(sets[0], sets[1], float(base), int(original), attention_factor(scaling, max_positions))

    def rows(self, factors: tuple[float, ...], start: int, stop: int) -> torch.Tensor:
        """cat(cos, sin) * a of positions start..stop-1 with theta_i / factors[i]: [stop - start, rot_dim]."""
        cpu = torch.device("cpu")
        shape = torch.arange(0, 2 * len(factors), 2, dtype=torch.int64, device=cpu).float() / (2 * len(factors))
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32, device=cpu) * self.base ** shape)  # [rot/2]
        freqs = torch.outer(torch.arange(start, stop, dtype=torch.float32, device=cpu), inv_freq)  # [n, rot/2]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_factor

    def table(self, size: int) -> torch.Tensor:
        """[size, rot_dim]: short rows below o, long rows from o on (what a decode token at p reads)."""
        cut = min(size, self.original)
        return torch.cat([self.rows(self.short, 0, cut), self.rows(self.long, cut, size)])

    def long_prefix(self) -> torch.Tensor:
        """[o, rot_dim]: long rows of positions 0..o-1 (a prefill of a sequence longer than o)."""
        return self.rows(self.long, 0, self.original)

    def prefix_tokens(self, meta) -> torch.Tensor | None:
        """[T] bool: the step's tokens below o of a sequence longer than o after this step (they read
        `long_prefix` instead of the table), or None when there are none (every decode step)."""
        o = self.original
        if not any(c < o < c + s for c, s in zip(meta.context_lens, meta.seq_lens)):
            return None
        lengths = torch.tensor(meta.kv_lens, device=meta.positions.device)  # [B]
        per_token = torch.repeat_interleave(lengths, torch.tensor(meta.seq_lens, device=lengths.device))  # [T]
        return (per_token > o) & (meta.positions < o)

    def step(self, cos: torch.Tensor, sin: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot_dim/2] read from `table` by position, with the `prefix_tokens` rows
        replaced by long_prefix's (a prefill of a sequence longer than o; else unchanged)."""
        flags = self.prefix_tokens(meta)
        if flags is None:
            return cos, sin
        prefix = self.long_prefix().to(cos.device)  # [o, rot]
        rows = prefix.index_select(0, meta.positions.clamp(max=self.original - 1)).to(cos.dtype).unsqueeze(1)
        half, flag = cos.shape[-1], flags[:, None, None]  # [T, 1, 1]
        return torch.where(flag, rows[..., :half], cos), torch.where(flag, rows[..., half:], sin)


def attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """a: `attention_factor` when given, else sqrt(1 + ln(s) / ln(o)) for s = `factor` (else
    max_positions / o) above 1, else 1 (transformers' _compute_longrope_parameters)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
