"""Multi-head latent attention (MLA, DeepSeek-V2 / V3): the KV cache holds one compressed latent and one
shared rope key per token, not per-head keys and values.

For a token x [hidden], H heads (H / tp on a rank), latent rank r (kv_lora_rank), d_n / d_r / d_v the
no-rope key, rope key and value dims per head:

    q        = W_q x, or W_qb RMSNorm(W_qa x) (q_lora_rank set)      [H, d_n + d_r] = [q_n ; q_r] per head
    [c ; k_r] = W_kva x                                               (kv_a_proj_with_mqa) [r + d_r]
    c        = RMSNorm(c) (kv_a_layernorm)                            the latent [r]
    q_r, k_r = rope(q_r, pos), rope(k_r, pos)                         k_r is shared by every head
    cache    <- [c ; k_r]                                             [r + d_r] per token per layer, no V

kv_b_proj W_kvb [H (d_n + d_v), r] expands the latent per head h into k_n = W_UK_h c and v = W_UV_h c
(W_UK_h [d_n, r], W_UV_h [d_v, r] its rows). The attention is computed absorbed, without expanding:

    score_hj = scale (q_n,h . W_UK_h c_j + q_r,h . k_r,j) = scale ([W_UK_h^T q_n,h ; q_r,h] . [c_j ; k_r,j])
    o_h      = sum_j softmax_j(score_hj) W_UV_h c_j = W_UV_h (sum_j p_hj c_j)
    out      = o_proj([o_1 ... o_H])                                  (dense, row-parallel)

which is exact: both sides are the same sums in another order. So every head attends with one query
[W_UK_h^T q_n,h ; q_r,h] of r + d_r over the one cached key row per token, and the values are the first r
dims of that same row (multi-query attention in the latent space). scale = (d_n + d_r)^-1/2, times a
family's factor (DeepSeek's YaRN mscale^2).

Tensor parallelism splits the heads (q_proj / q_b_proj and kv_b_proj column-parallel by head, o_proj
row-parallel); the latent path (q_a_proj, kv_a_proj_with_mqa, both norms) is replicated, so every rank
caches the same [c ; k_r]. kv_b_proj stays float under weight quantization (`LatentExpansion`, not a
Linear): its two halves are used as matrices (W_UK_h^T on the queries, W_UV_h on the attention's latent
output), never as a linear layer on an input; the other projections quantize like any Linear.

The attention reads the step's batch (core.kernels.metadata.AttentionMetadata): prefill, decode, a cached
prefix (context_lens > 0: reused blocks or an earlier chunk) and per-request windows (attention_window)
alike, in torch (`latent_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bestiary.core.kernels.attention_window import FULL, visible_keys, window_visible
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.layers.kv_geometry import KVPoolGeometry
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.layers.norm import RMSNorm
from bestiary.core.layers.rotary import Rotary


def latent_pool_geometry(kv_lora_rank: int, qk_rope_head_dim: int) -> KVPoolGeometry:
    """The pool of multi-head latent attention on any rank: one row [c ; k_r] of r + d_r, no V pool."""
    return KVPoolGeometry(kv_heads=1, k_dim=kv_lora_rank + qk_rope_head_dim, v_dim=0)


def latent_attention(q: torch.Tensor, fresh: torch.Tensor, meta: AttentionMetadata, pool: torch.Tensor,
                     scale: float, latent_dim: int) -> torch.Tensor:
    """softmax(scale q . key) over the keys each query sees, times the keys' first `latent_dim` dims.

    q [T, H, D] (D = r + d_r, absorbed queries), fresh [T, D] (this step's rows, already in `pool`),
    pool [num_blocks, block_size, 1, D] -> [T, H, r]. Causal; per-request windows (meta.windows) as
    core.kernels.attention_window says; a fresh prompt reads its own rows, anything else the pool. Through
    torch's scaled_dot_product_attention: every head's query against the one key row, the values its first
    r dims (its fused kernels tile the scores, never an [H, n, K] matrix at once)."""
    bounds = meta.window_bounds(FULL)
    rows = pool.view(-1, pool.shape[-1])  # [slots, D]
    outs, start, bs = [], 0, meta.block_size
    for i, (n, ctx) in enumerate(zip(meta.seq_lens, meta.context_lens)):
        window, sinks = (bounds[0][i], bounds[1][i]) if bounds is not None else (FULL, 0)
        k_pos = visible_keys(ctx, ctx + n - 1, window, sinks).to(q.device)  # [K]
        if ctx == 0 and window == FULL:
            keys = fresh[start:start + n]  # [n, D]
        else:
            keys = rows.index_select(0, meta.block_tables[i, k_pos // bs] * bs + k_pos % bs)  # [K, D]
        keys = keys.to(q.dtype)[None, None]  # [1, 1, K, D]: one kv head for every query head
        qi = q[start:start + n].transpose(0, 1)[None]  # [1, H, n, D]
        if ctx == 0 and window == FULL:
            o = F.scaled_dot_product_attention(qi, keys, keys[..., :latent_dim], is_causal=True, scale=scale,
                                               enable_gqa=True)  # [1, H, n, r]
        else:
            visible = window_visible(torch.arange(ctx, ctx + n, device=q.device), k_pos, window, sinks)  # [n, K]
            o = F.scaled_dot_product_attention(qi, keys, keys[..., :latent_dim], attn_mask=visible, scale=scale,
                                               enable_gqa=True)
        outs.append(o[0].transpose(0, 1))  # [n, H, r]
        start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class LatentExpansion(nn.Module):
    """kv_b_proj: weight [H_local (d_n + d_v), r], the rank's heads' rows of W_UK_h and W_UV_h, head-major.

    Not a Linear: it is never applied to an input as a whole (absorbed: module docstring), so it is not
    quantized and its weight keeps the checkpoint's layout. Column-parallel by head (tp_dim 0)."""

    def __init__(self, heads: int, per_head: int, rank: int, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.heads, self.per_head, self.rank = heads, per_head, rank
        self.weight = nn.Parameter(torch.empty(heads * per_head, rank, dtype=dtype, device=device), requires_grad=False)

    def tp_dim(self, param_name: str) -> int:
        """The loader slices whole heads' rows: dim 0."""
        return 0

    def halves(self, nope: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, d_n, r], W_UV [H, d_v, r]) in `dtype`."""
        w = self.weight.view(self.heads, self.per_head, self.rank)
        return w[:, :nope].to(dtype), w[:, nope:].to(dtype)


class MultiHeadLatentAttention(nn.Module):
    """x [T, hidden] -> [T, hidden] for the local heads of rank `tp_rank` (module docstring).

    Submodules (checkpoint names under `attention`): q_proj, or q_a_proj + q_a_layernorm + q_b_proj;
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; dense (o_proj). `norm_eps` is the two latent norms'
    epsilon (DeepSeek's are RMSNorms of its default 1e-6, not rms_norm_eps)."""

    def __init__(self, hidden: int, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, rotary: Rotary, q_lora_rank: int | None = None, scale: float | None = None,
                 bias: bool = False, norm_eps: float = 1e-6, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        if num_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide num_attention_heads {num_heads}")
        self.heads, self.rank = num_heads // tp_size, kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        q_dim = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        place = dict(dtype=dtype, device=device)
        split = dict(tp_rank=tp_rank, tp_size=tp_size, **place)
        self.q_lora = q_lora_rank is not None
        if q_lora_rank is None:
            self.q_proj = Linear(hidden, q_dim, parallel=Parallel.COLUMN, **split)
        else:
            self.q_a_proj = Linear(hidden, q_lora_rank, bias=bias, **place)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, **place)
            self.q_b_proj = Linear(q_lora_rank, q_dim, parallel=Parallel.COLUMN, **split)
        self.kv_a_proj_with_mqa = Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias, **place)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, **place)
        self.kv_b_proj = LatentExpansion(num_heads // tp_size, qk_nope_head_dim + v_head_dim, kv_lora_rank, **place)
        self.dense = Linear(num_heads * v_head_dim, hidden, bias=bias, parallel=Parallel.ROW, **split)
        self.rotary = rotary
        self.scale = scale if scale is not None else (qk_nope_head_dim + qk_rope_head_dim) ** -0.5

    def queries(self, x: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (q_n [T, H, d_n], q_r [T, H, d_r] unrotated)."""
        q = self.q_proj(x, meta.lora) if not self.q_lora else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, meta.lora)), meta.lora)
        q = q.view(x.shape[0], self.heads, self.nope + self.rope)  # [T, H, d_n + d_r]
        return q[..., :self.nope], q[..., self.nope:].contiguous()

    def latent(self, x: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (c [T, r] normed, k_r [T, 1, d_r] unrotated)."""
        ckv = self.kv_a_proj_with_mqa(x, meta.lora)  # [T, r + d_r]
        c = self.kv_a_layernorm(ckv[:, :self.rank].contiguous())  # [T, r]
        return c, ckv[:, self.rank:].contiguous().view(x.shape[0], 1, self.rope)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor,
                v_pool: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; k_pool [num_blocks, block_size, 1, r + d_r] holds [c ; k_r]
        (v_pool, the empty V pool of a latent cache, is not read)."""
        t = x.shape[0]
        q_n, q_r = self.queries(x, meta)
        c, k_r = self.latent(x, meta)
        cos, sin = self.rotary.step_cos_sin(meta, q_r.dtype)  # shared by all layers of a step
        self.rotary.rotate(q_r, cos, sin)  # [T, H, d_r] in place
        self.rotary.rotate(k_r, cos, sin)  # [T, 1, d_r]
        fresh = torch.cat([c, k_r.view(t, self.rope)], dim=-1)  # [T, r + d_r]
        k_pool.view(-1, fresh.shape[-1]).index_copy_(0, meta.slot_mapping, fresh.to(k_pool.dtype))
        w_uk, w_uv = self.kv_b_proj.halves(self.nope, x.dtype)  # [H, d_n, r], [H, d_v, r]
        q = torch.cat([torch.einsum("thn,hnr->thr", q_n, w_uk), q_r], dim=-1)  # [T, H, r + d_r]
        o = latent_attention(q, fresh, meta, k_pool, self.scale, self.rank)  # [T, H, r]
        o = torch.einsum("thr,hvr->thv", o, w_uv).reshape(t, self.heads * self.v_dim)  # [T, H d_v]
        return self.dense(o, meta.lora)
