"""Embeddings of a causal LM: its final-norm hidden states pooled over a prompt and L2-normalised.

    hidden h_t = ln_f(x_t)             [H], t = 0 .. T-1 (transformers' `last_hidden_state`)
    last:  e = h_{T-1}                 the last token has attended to every token before it
    mean:  e = (1 / T) sum_t h_t
    out:   e / max(||e||_2, 1e-12)     (torch.nn.functional.normalize), unless normalize=False

A prompt's hidden rows arrive a prefill chunk at a time (the executor's chunked prefill, batched
with other requests' work); `accumulate` keeps what the pooling needs: the running float32 sum,
or the newest last row. Last-token pooling may start from cached prefix blocks (only the last
token's row is needed, and it is always computed); mean pooling computes every prompt token.
"""

from __future__ import annotations

from typing import Literal

import torch

Pooling = Literal["last", "mean"]
POOLINGS: tuple[Pooling, ...] = ("last", "mean")


def check_pooling(pooling: str, where: str = "pooling") -> Pooling:
    """`pooling` when it is one this module does; else a one-line error naming `where`."""
    from bestiary.core.format.errors import BestiaryError

    if pooling not in POOLINGS:
        raise BestiaryError(f"{where} {pooling!r}: expected one of {', '.join(POOLINGS)}")
    return pooling  # checked against POOLINGS just above


def accumulate(pooled: torch.Tensor | None, rows: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """The pooling state after one prefill chunk's hidden rows [n, H]: float32 sum [H] (mean) or last row [H]."""
    if pooling == "last":
        return rows[-1].float().clone()
    chunk = rows.float().sum(0)  # [H]
    return chunk if pooled is None else pooled + chunk


def pooled_embedding(pooled: torch.Tensor, pooling: Pooling, num_tokens: int, normalize: bool = True) -> torch.Tensor:
    """The embedding [H] (float32) of a prompt of `num_tokens` tokens from its pooling state."""
    e = pooled / num_tokens if pooling == "mean" else pooled
    return torch.nn.functional.normalize(e, dim=0) if normalize else e
