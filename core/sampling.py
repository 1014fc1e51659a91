"""Sampling parameters and the sampler.

Semantics: temperature 0 or top_k == 1 is greedy; top_k == 0 and top_p == 1.0 are off.
Otherwise logits / temperature are filtered to the top_k largest, then to the smallest
set whose probability mass reaches top_p, renormalised and sampled with the request's
own generator (seeded by random_seed, so a seed reproduces a run).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingConfig(BaseModel):
    """Per-request generation parameters."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(64, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy.")
    top_k: int = Field(0, ge=0, description="0 = off; 1 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1.0 = off.")
    random_seed: int | None = Field(None, description="Seed of this request's generator.")
    end_id: int | None = Field(None, description="Stop token; defaults to the tokenizer's EOS.")
    ignore_eos: bool = Field(False, description="Keep generating past end_id.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded by `seed` (a random seed when None)."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with everything outside top-k / top-p set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingConfig], generators: list[torch.Generator]) -> list[int]:
    """One token per row of logits [B, V]."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, p, gen, g in zip(logits, params, generators, greedy):
        if p.is_greedy:
            out.append(g)
            continue
        filtered = filter_logits(row / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(filtered, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
