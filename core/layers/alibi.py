"""ALiBi (attention with linear biases), the position mechanism of BLOOM and Baichuan2-13B:

    scores_h(i, j) = q_i . k_j * scale + m_h * (j - i)     (j <= i; m_h * j alone is equivalent)

with slopes m_h = 2^(-8 h' / n) for h' = 1..n, n the largest power of two <= H, and for the
remaining H - n heads the odd powers of 2^(-4 / n) (`attention.alibi_slopes`). The attention op
(`PagedAttention(alibi=...)`: torch prefill / decode, Triton, the compiled CPU plan) adds the bias;
a layer passes it the slopes of its own heads.
"""

from __future__ import annotations

import torch

from bestiary.core.layers.attention import alibi_slopes


def rank_alibi_slopes(num_heads: int, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
    """Slopes [H / tp] of the query heads tensor-parallel rank `tp_rank` holds (float32, on the CPU:
    they are no weight, so they must not land on the meta device a model is built on; the
    attention op moves them where it runs)."""
    if num_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide num_attention_heads {num_heads}")
    per_rank = num_heads // tp_size
    with torch.device("cpu"):
        return alibi_slopes(num_heads)[tp_rank * per_rank : (tp_rank + 1) * per_rank].contiguous()
