"""Attention over the paged KV cache: packed variable-length prefill and batched decode.

Layout (core.kernels.metadata): queries of all sequences packed as q [T, H, D]; K and V
pools [num_blocks, block_size, KVH, D]; key j of sequence b lives in block
block_tables[b, j // block_size] at offset j % block_size. The new keys are already in
the pool (PagedAttention writes them first). Sequence b has n_b new queries at positions
ctx_b .. ctx_b + n_b - 1. For query i and key j of a sequence, head h, kv head h // (H/KVH):

    s_ij = scale * q_i . k_j + slope_h * (j - i) + key_bias_h(j)   (alibi / key bias optional)
    visible(i, j) = j <= i  or  j < prefix_len          (prefix_lm; causal: prefix_len = 0)
    out_i = sum_j softmax_j(s_ij over visible j) v_j    -> [T, H * D]

With a window (W_b, S_b) (core.kernels.attention_window) visible(i, j) also needs
j < S_b or i - j < W_b - S_b; the key loop then visits the sink tiles and the tiles from the
first query's window start only, and loads only keys some query of the tile may see (the
blocks before that are released: never read).

Decode is the case n_b = 1 (the query sees every cached key). The kernels keep a
running max and sum (online softmax, FlashAttention style) over key tiles of BLOCK_N,
gathering each key's slot from the block table, so BLOCK_N and block_size are unrelated.
Prefill: one program per (sequence, head, BLOCK_M queries). Decode: one program per
(sequence, kv head) computing all H/KVH query heads of the group in one tile (GQA/MQA).

The torch reference is core.kernels.attention_ref's prefill_attention / decode_attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bestiary.core.kernels.attention_ref import (
    decode_attention,
    decode_rows_apart,
    prefill_attention,
    windowed_attention,
)
from bestiary.core.kernels.metadata import AttentionMetadata

Bounds = tuple[list[int], list[int]]  # per-sequence (windows, sinks) of one layer, AttentionMetadata.window_bounds

# --- torch reference (the CPU path: core.kernels.attention_ref) ----------------------------


def paged_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
    k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, slopes: torch.Tensor | None,
    key_bias: Callable[[torch.Tensor], torch.Tensor] | None = None, bounds: Bounds | None = None,
) -> torch.Tensor:
    """q [T, H, D] (k, v [T, KVH, D] already in the pools) -> [T, H*D] with torch ops.

    On the CPU a step mixing one-token rows (decodes) with longer ones attends the one-token rows
    as a decode step would (`attention_ref.decode_rows_apart`: batch invariance)."""
    if not meta.is_decode and q.device.type == "cpu" and 1 in meta.seq_lens:
        return decode_rows_apart(q, k, v, meta, k_pool, v_pool, scale, slopes, key_bias, bounds, paged_attention_ref)
    if bounds is not None:
        return windowed_attention(q, k, v, meta, k_pool, v_pool, scale, slopes, key_bias, *bounds)
    if meta.is_decode:  # one query at the last position sees every key under any mask
        return decode_attention(q, meta, k_pool, v_pool, scale, slopes, key_bias)
    return prefill_attention(q, k, v, meta, k_pool, v_pool, scale, slopes, key_bias)


# --- Triton kernels ------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    pool_ptr, stride_pb, stride_ps, stride_ph, table_row_ptr, kvh, offs_n, n_mask, offs_d, d_mask, block_size,
):
    """Keys (or values) at positions offs_n of one sequence and kv head: [BLOCK_N, BLOCK_D]."""
    blk = tl.load(table_row_ptr + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    slot = (offs_n % block_size).to(tl.int64)
    ptrs = pool_ptr + blk[:, None] * stride_pb + slot[:, None] * stride_ps + kvh * stride_ph + offs_d[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _window_walk(q_first, end, win_ptr, sink_ptr, b, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """(lo, sink tiles, tiles) of the key walk of queries from q_first on: lo = the first query's
    rolling start (0 without a window), the tiles over [0, min(S, lo rounded down)) then the tiles
    from lo's up to `end`."""
    lo = q_first * 0
    sink_end = q_first * 0
    if WINDOWED:
        win = tl.load(win_ptr + b)
        sinks = tl.load(sink_ptr + b)
        lo = tl.where(win > 0, tl.maximum(q_first - (win - sinks) + 1, 0), 0)
        sink_end = tl.minimum(sinks, (lo // BLOCK_N) * BLOCK_N)
    n_sink = tl.cdiv(sink_end, BLOCK_N)
    return lo, n_sink, n_sink + tl.cdiv(end, BLOCK_N) - lo // BLOCK_N


@triton.jit
def _window_tile(t, lo, n_sink, end, win_ptr, sink_ptr, b, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """Key positions of walk tile t [BLOCK_N], the keys to load (j < end and j < S or j >= lo: some
    query may see them) and the per-sequence (window, sinks) ((0, 0) without a window). The sink
    tiles end before lo's tile, so no key is visited twice."""
    start = tl.where(t < n_sink, t * BLOCK_N, (lo // BLOCK_N + t - n_sink) * BLOCK_N)
    offs_n = start + tl.arange(0, BLOCK_N)
    win = b * 0
    sinks = b * 0
    if WINDOWED:
        win = tl.load(win_ptr + b)
        sinks = tl.load(sink_ptr + b)
    load = (offs_n < end) & ((offs_n < sinks) | (offs_n >= lo))
    return offs_n, load, win, sinks


@triton.jit
def _prefill_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_pb, stride_ps, stride_ph,
    o_ptr, stride_ot,
    table_ptr, stride_tb,
    q_start_ptr, seq_len_ptr, ctx_len_ptr, prefix_ptr,
    slopes_ptr, kb_ptr, stride_kbh,
    win_ptr, sink_ptr,
    scale, head_dim, block_size,
    GROUP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, WINDOWED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    n = tl.load(seq_len_ptr + b)
    if mb * BLOCK_M >= n:
        return
    ctx = tl.load(ctx_len_ptr + b)
    q0 = tl.load(q_start_ptr + b).to(tl.int64)
    prefix = tl.load(prefix_ptr + b)
    kvh = h // GROUP
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence's new tokens
    m_mask = offs_m < n
    q_pos = ctx + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_ptrs = q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if HAS_ALIBI:
        slope = tl.load(slopes_ptr + h).to(tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    # Keys any query of this tile may see: up to its last query, or the whole prefix.
    end = tl.minimum(ctx + n, tl.maximum(ctx + (mb + 1) * BLOCK_M, prefix))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, n_sink, n_tiles = _window_walk(ctx + mb * BLOCK_M, end, win_ptr, sink_ptr, b, BLOCK_N, WINDOWED)
    for t in range(n_tiles):
        offs_n, n_mask, win, sinks = _window_tile(t, lo, n_sink, end, win_ptr, sink_ptr, b, BLOCK_N, WINDOWED)
        k = _load_kv_tile(k_ptr, stride_pb, stride_ps, stride_ph, table_row, kvh, offs_n, n_mask, offs_d, d_mask,
                          block_size)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * scale  # [BLOCK_M, BLOCK_N]
        if HAS_ALIBI:
            s += slope * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)
        if HAS_KEY_BIAS:
            s += tl.load(kb_ptr + h * stride_kbh + offs_n, mask=n_mask, other=0.0)[None, :]
        visible = ((offs_n[None, :] <= q_pos[:, None]) | (offs_n[None, :] < prefix)) & n_mask[None, :]
        if WINDOWED:
            rel = q_pos[:, None] - offs_n[None, :]
            visible = visible & ((win == 0) | (offs_n[None, :] < sinks) | (rel < win - sinks))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # -inf for a row that has seen no key yet
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(v_ptr, stride_pb, stride_ps, stride_ph, table_row, kvh, offs_n, n_mask, offs_d, d_mask,
                          block_size)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + (q0 + offs_m)[:, None] * stride_ot + h * head_dim + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_pb, stride_ps, stride_ph,
    o_ptr, stride_ot,
    table_ptr, stride_tb,
    kv_len_ptr,
    slopes_ptr, kb_ptr, stride_kbh,
    win_ptr, sink_ptr,
    scale, head_dim, block_size,
    GROUP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, WINDOWED: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    kv_len = tl.load(kv_len_ptr + b)
    q_pos = kv_len - 1
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # the query heads of this kv head
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    qo_mask = g_mask[:, None] & d_mask[None, :]
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=qo_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
    if HAS_ALIBI:
        slope = tl.load(slopes_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo, n_sink, n_tiles = _window_walk(q_pos, kv_len, win_ptr, sink_ptr, b, BLOCK_N, WINDOWED)
    for t in range(n_tiles):
        offs_n, n_mask, _, _ = _window_tile(t, lo, n_sink, kv_len, win_ptr, sink_ptr, b, BLOCK_N, WINDOWED)
        k = _load_kv_tile(k_ptr, stride_pb, stride_ps, stride_ph, table_row, kvh, offs_n, n_mask, offs_d, d_mask,
                          block_size)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * scale  # [BLOCK_G, BLOCK_N]
        if HAS_ALIBI:
            s += slope[:, None] * (offs_n - q_pos).to(tl.float32)[None, :]
        if HAS_KEY_BIAS:
            kb_ptrs = kb_ptr + heads[:, None] * stride_kbh + offs_n[None, :]
            s += tl.load(kb_ptrs, mask=g_mask[:, None] & n_mask[None, :], other=0.0)
        s = tl.where(n_mask[None, :], s, float("-inf"))  # n_mask: exactly the keys the query sees
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(v_ptr, stride_pb, stride_ps, stride_ph, table_row, kvh, offs_n, n_mask, offs_d, d_mask,
                          block_size)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * head_dim + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=qo_mask)


# --- launchers -----------------------------------------------------------------------------


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for float32 models, tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _window_args(meta: AttentionMetadata, bounds: Bounds | None, device: torch.device, fallback: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows, sinks) int32 [B] on `device` (cached per step and layer window); `fallback` twice without."""
    if bounds is None:
        return fallback, fallback
    key = ("window_args", device, tuple(bounds[0]), tuple(bounds[1]))
    packed = meta.step_value(key, lambda: torch.tensor(bounds, dtype=torch.int32).to(device))
    return packed[0], packed[1]


def _sequence_args(meta: AttentionMetadata, device: torch.device) -> dict[str, torch.Tensor]:
    """int32 per-sequence tensors on `device`, built once per step and cached on `meta`."""
    cache = meta._kernel_args
    if device not in cache:
        starts = [0]
        for n in meta.seq_lens[:-1]:
            starts.append(starts[-1] + n)
        prefix = meta.prefix_lens if meta.mask == "prefix_lm" and meta.prefix_lens else [0] * len(meta.seq_lens)
        rows = dict(q_start=starts, seq_len=meta.seq_lens, ctx_len=meta.context_lens, prefix=prefix,
                    kv_len=meta.kv_lens)
        packed = torch.tensor(list(rows.values()), dtype=torch.int32).to(device)  # one copy for all five
        cache[device] = dict(zip(rows, packed.unbind(0)), table=meta.block_tables.to(device))
    return cache[device]


def _bias_args(
    q: torch.Tensor, slopes: torch.Tensor | None, key_bias: Callable[[torch.Tensor], torch.Tensor] | None, length: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(slopes [H] float32, key bias [H, length] float32, its row stride); q stands in for an absent one."""
    s = slopes.to(device=q.device, dtype=torch.float32).contiguous() if slopes is not None else q
    if key_bias is None:
        return s, q, 0
    kb = key_bias(torch.arange(length, device=q.device)).to(torch.float32).contiguous()  # [H, L]
    return s, kb, kb.stride(0)


def prefill(
    q: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float,
    slopes: torch.Tensor | None = None, key_bias: Callable[[torch.Tensor], torch.Tensor] | None = None,
    block_m: int | None = None, block_n: int | None = None, bounds: Bounds | None = None,
) -> torch.Tensor:
    """Triton prefill over packed sequences: q [T, H, D] -> [T, H*D] (bounds: per-sequence windows)."""
    t, h, d = q.shape
    kvh = k_pool.shape[2]
    args = _sequence_args(meta, q.device)
    max_n = max(meta.seq_lens)
    block_m = block_m or (64 if max_n >= 64 else 16)
    block_n = block_n or 64
    s, kb, stride_kb = _bias_args(q, slopes, key_bias, max(meta.kv_lens))
    win, sinks = _window_args(meta, bounds, q.device, args["seq_len"])
    out = torch.empty(t, h * d, dtype=q.dtype, device=q.device)
    grid = (len(meta.seq_lens), h, triton.cdiv(max_n, block_m))
    _prefill_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_pool, v_pool, k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out, out.stride(0),
        args["table"], args["table"].stride(0),
        args["q_start"], args["seq_len"], args["ctx_len"], args["prefix"],
        s, kb, stride_kb,
        win, sinks,
        scale, d, k_pool.shape[1],
        GROUP=h // kvh, HAS_ALIBI=slopes is not None, HAS_KEY_BIAS=key_bias is not None, WINDOWED=bounds is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_PREC=dot_precision(q.dtype),
    )
    return out


def decode(
    q: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float,
    slopes: torch.Tensor | None = None, key_bias: Callable[[torch.Tensor], torch.Tensor] | None = None,
    block_n: int | None = None, bounds: Bounds | None = None,
) -> torch.Tensor:
    """Triton decode, one query per sequence: q [B, H, D] -> [B, H*D] (bounds: per-sequence windows)."""
    b, h, d = q.shape
    kvh = k_pool.shape[2]
    args = _sequence_args(meta, q.device)
    s, kb, stride_kb = _bias_args(q, slopes, key_bias, max(meta.kv_lens))
    win, sinks = _window_args(meta, bounds, q.device, args["kv_len"])
    out = torch.empty(b, h * d, dtype=q.dtype, device=q.device)
    _decode_kernel[(b, kvh)](
        q, q.stride(0), q.stride(1),
        k_pool, v_pool, k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out, out.stride(0),
        args["table"], args["table"].stride(0),
        args["kv_len"],
        s, kb, stride_kb,
        win, sinks,
        scale, d, k_pool.shape[1],
        GROUP=h // kvh, HAS_ALIBI=slopes is not None, HAS_KEY_BIAS=key_bias is not None, WINDOWED=bounds is not None,
        BLOCK_G=max(16, triton.next_power_of_2(h // kvh)), BLOCK_N=block_n or 64,
        BLOCK_D=max(16, triton.next_power_of_2(d)), DOT_PREC=dot_precision(q.dtype),
    )
    return out


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
    k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, slopes: torch.Tensor | None,
    key_bias: Callable[[torch.Tensor], torch.Tensor] | None = None, bounds: Bounds | None = None,
) -> torch.Tensor:
    """Triton: q [T, H, D] (k, v [T, KVH, D] already in the pools) -> [T, H*D]."""
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride() != k_pool.stride():
        raise ValueError("attention kernel: q and the pools need a unit last stride, K and V pools one layout")
    if meta.is_decode:
        return decode(q, meta, k_pool, v_pool, scale, slopes, key_bias, bounds=bounds)
    return prefill(q, meta, k_pool, v_pool, scale, slopes, key_bias, bounds=bounds)
