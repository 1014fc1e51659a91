"""The attention op of a decoder layer: write this step's K/V to the paged cache, then attend.

    out = softmax(q k^T * scale + bias) v     over the keys each query may see
    out = softmax(c tanh(q k^T * scale / c) + bias) v      with a logit soft-cap c (Gemma 2)
    out_i = sum_j exp(s_ij) / (exp(a_h) + sum_j' exp(s_ij')) v_j   with sink logits a [H] (gpt-oss)

Sink logits are learned parameters, one per query head (`sink_logits` [H_local]: a tensor-parallel
rank holds its own heads' logits, cut by head like q); they are not the StreamingLLM sink tokens a
window keeps (meta.sinks, core.kernels.attention_window).

The math, the masks and the packed layout are core.kernels.attention_ref's (the torch path) and
core.kernels.attention's (Triton); the step's batch is core.kernels.metadata.AttentionMetadata.
`alibi_slopes` gives the ALiBi slopes an architecture passes as `alibi`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from bestiary.core.kernels import dispatch
from bestiary.core.kernels.attention_ref import write_kv
from bestiary.core.kernels.attention_window import FULL
from bestiary.core.kernels.metadata import AttentionMetadata, KeyBias


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes [num_heads]: geometric sequence 2^(-8 i / n) (with the interleave for non-powers of 2)."""
    import math

    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


class KVPoolQuant(Protocol):
    """What core.quant installs as `PagedAttention.kv_quant` (core.quant.kv.KVQuant): the INT8 / FP8
    pools' scales and their dequantized blocks."""

    @property
    def scales(self) -> torch.Tensor: ...

    def float_pools(self, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


class PagedAttention(nn.Module):
    """The attention op of a layer: writes new K/V to the pool, then attends.

    q [T, H, D], k/v [T, KVH, D] (local heads of this rank) -> [T, H*D].
    """

    def __init__(
        self, head_dim: int, scale: float | None = None, alibi: torch.Tensor | None = None,
        key_bias: KeyBias | None = None, softcap: float | None = None, sink_heads: int = 0,
        dtype: torch.dtype = torch.float32, device=None,
    ) -> None:
        """sink_heads: this rank's query heads when the layer has sink logits (a parameter [sink_heads]), else 0."""
        super().__init__()
        self.scale = scale if scale is not None else head_dim**-0.5
        self.softcap = softcap  # c of the scores' soft-cap c tanh(s / c), or None (core.kernels.attention_ref)
        self.alibi = alibi  # [H_local] slopes or None
        self.key_bias = key_bias  # k_pos [L] -> [H_local, L], or None
        self.kv_quant: KVPoolQuant | None = None  # INT8/FP8 pools
        self.window = FULL  # this layer's sliding window (DecoderLM sets it from the config; 0: none)
        # a_h of each local query head: exp(a_h) joins the softmax's denominator (module doc), or None
        self.sink_logits = nn.Parameter(torch.empty(sink_heads, dtype=dtype, device=device),
                                        requires_grad=False) if sink_heads else None

    def tp_dim(self, param_name: str) -> int:
        """sink_logits [H_local] is cut by query head (dim 0), as q is."""
        return 0 if param_name == "sink_logits" else -1

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        k_pool: torch.Tensor, v_pool: torch.Tensor,
    ) -> torch.Tensor:
        kv_scales = None
        if self.kv_quant is not None:  # INT8/FP8 pools
            write_kv(k_pool, v_pool, k, v, meta.slot_mapping, self.kv_quant.scales)
            # compiled CPU decode reads the codes (it has no soft-cap, no sink logits)
            if self.softcap is None and self.sink_logits is None and dispatch.reads_kv_codes(q, meta, k_pool,
                                                                                               self.key_bias):
                kv_scales = self.kv_quant.scales
            else:  # attend over this step's blocks, dequantized
                k_pool, v_pool = self.kv_quant.float_pools(k_pool, v_pool, meta, q.dtype)
        else:
            write_kv(k_pool, v_pool, k, v, meta.slot_mapping)
        # Triton kernels on CUDA; on the CPU paged_attention_ref = decode/prefill_attention below.
        return dispatch.paged_attention(q, k, v, meta, k_pool, v_pool, self.scale, self.alibi, self.key_bias,
                                        kv_scales, window=self.window, softcap=self.softcap,
                                        sink_logits=self.sink_logits)
