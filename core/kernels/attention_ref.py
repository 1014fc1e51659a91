"""Attention over the paged KV cache in torch: the reference of the Triton kernels and the CPU path.

For query i and key j of a sequence, head h (kv head h // (H/KVH)):

    out = softmax(q k^T * scale + bias) v,   bias = alibi_slope_h * (j - i) or 0, -inf where masked

visible(i, j) = j <= i (causal), or also j < prefix_len (prefix-LM); a layer's sliding window and
the step's per-sequence windows and sinks (meta.windows / sinks) restrict the visible keys further
(core.kernels.attention_window); `windowed_attention` gathers only those keys.

Instead of slopes, an architecture may give a `key_bias`: a function of the key positions
j [L] -> [H_local, L] added the same way (bias_h(j) - bias_h(i) would be equivalent under the
softmax; this form lets an architecture reproduce a reference's exact rounding, e.g.
Falcon's bf16 ALiBi).

With a logit soft-cap c (Gemma 2) the scores are capped before the bias: s = c tanh(q k^T * scale / c),
computed in float32 (`capped_attention`: every device, no compiled kernel has the cap).

With sink logits (gpt-oss: one learned logit a_h per query head) the softmax has one more term per
head that takes probability mass and carries no value:

    p_ij = exp(s_ij) / (exp(a_h) + sum_j' exp(s_ij'))          out_i = sum_j p_ij v_j

also on `capped_attention`'s explicit float32 scores. These are not StreamingLLM's sink TOKENS (the first
S cache positions a window keeps, meta.sinks / core.kernels.attention_window): a sink logit is a
per-head parameter, no key position.

`write_kv` stores a step's new keys and values in the pools first (INT8/FP8 pools get codes,
core.kernels.kv_codes); `prefill_attention` / `decode_attention` then read them back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bestiary.core.kernels import dispatch
from bestiary.core.kernels.attention_window import first_key, visible_keys, window_visible
from bestiary.core.kernels.kv_codes import as_bytes, quantize_kv
from bestiary.core.kernels.metadata import AttentionMetadata, KeyBias


def _mask_bias(
    n: int, ctx: int, mask: str, prefix_len: int, slopes: torch.Tensor | None, dtype: torch.dtype, device,
    key_bias: KeyBias | None = None,
) -> torch.Tensor:
    """Additive bias [H or 1, n, ctx + n] for n queries at positions ctx..ctx+n-1."""
    q_pos = torch.arange(ctx, ctx + n, device=device)[:, None]  # [n, 1]
    k_pos = torch.arange(ctx + n, device=device)[None, :]  # [1, L]
    visible = k_pos <= q_pos
    if mask == "prefix_lm":
        visible = visible | (k_pos < prefix_len)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=device).masked_fill_(~visible, float("-inf"))
    bias = bias[None]
    if slopes is not None:
        bias = bias + slopes.to(device)[:, None, None] * (k_pos - q_pos)[None].float()
    if key_bias is not None:
        bias = bias + key_bias(k_pos[0])[:, None, :]  # [H, 1, L]
    return bias.to(dtype)


def write_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    """Store k, v [T, KVH, D] at flat `slots` [T] of pools [num_blocks, block_size, KVH, D].

    INT8/FP8 pools get codes k / s_k, v / s_v with `scales` = (s_k, s_v) (core.kernels.kv_codes)."""
    if scales is not None:
        k, v = quantize_kv(k, scales[0], k_pool.dtype), quantize_kv(v, scales[1], v_pool.dtype)
        # float8 through uint8 views: the CPU has no index_copy_ for float8
        k_pool, v_pool, k, v = as_bytes(k_pool), as_bytes(v_pool), as_bytes(k), as_bytes(v)
    k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slots, v.to(v_pool.dtype))


def _gather_kv(pool: torch.Tensor, table: torch.Tensor, length: int, start: int | None = None) -> torch.Tensor:
    """Keys of one or more sequences: pool[table] -> [B, length, KVH, D] (table [B, nb]).

    With `start` (one sequence whose blocks are start, start + 1, ...) a view of the pool.
    """
    nb = -(-length // pool.shape[1])
    if start is not None and table.shape[0] == 1:
        return pool[start : start + nb].flatten(0, 1)[None, :length]  # [1, length, KVH, D], no copy
    kv = pool[table[:, :nb]]  # [B, nb, block_size, KVH, D]
    return kv.flatten(1, 2)[:, :length]


def decode_attention(
    q: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor,
    scale: float, slopes: torch.Tensor | None, key_bias: KeyBias | None = None,
) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] against the cached keys -> [B, H*D].

    On the CPU (and for B == 1) each sequence attends over its own keys, a view of the pool
    when its blocks are contiguous: no padded [B, L_max] copy of K and V, no masking. Elsewhere
    the sequences are gathered into one padded batch."""
    b = q.shape[0]
    if b == 1 or q.device.type == "cpu":
        outs = []
        for i, length in enumerate(meta.kv_lens):
            first = meta.contiguous_from[i] if meta.contiguous_from else None
            table = meta.block_tables[i : i + 1]
            k = _gather_kv(k_pool, table, length, first)[0]  # [L, KVH, D]
            v = _gather_kv(v_pool, table, length, first)[0]
            outs.append(_decode_one(q[i], k, v, scale, slopes, key_bias))
        return outs[0][None] if b == 1 else torch.stack(outs)
    return _decode_padded(q, meta, k_pool, v_pool, scale, slopes, key_bias)


def _decode_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, slopes: torch.Tensor | None,
    key_bias: KeyBias | None,
) -> torch.Tensor:
    """softmax(q K^T * scale + bias) V for one sequence: q [H, D], k/v [L, KVH, D] -> [H*D].

    bias = slope_h * (j - (L - 1)) with alibi, + key_bias(j)[h] where given."""
    h, d = q.shape
    length, kvh = k.shape[0], k.shape[1]
    qg = q.view(kvh, h // kvh, d)  # [KVH, G, D]
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        # These skinny half-precision matmuls are ~1.6x slower than fp32 on the CPU (measured,
        # SmolLM2 shapes): compute in fp32 and round the output once.
        qg, k, v = qg.float(), k.float(), v.float()
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * scale  # [KVH, G, L]
    if slopes is not None:
        rel = torch.arange(length, device=q.device) - (length - 1)  # [L]
        scores = scores + (slopes.view(kvh, h // kvh, 1) * rel).to(scores.dtype)
    if key_bias is not None:
        kb = key_bias(torch.arange(length, device=q.device))  # [H, L]
        scores = scores + kb.view(kvh, h // kvh, length).to(scores.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.matmul(probs, v.transpose(0, 1))  # [KVH, G, D]
    return out.reshape(h * d).to(q.dtype)


def _decode_padded(
    q: torch.Tensor, meta: AttentionMetadata, k_pool: torch.Tensor, v_pool: torch.Tensor,
    scale: float, slopes: torch.Tensor | None, key_bias: KeyBias | None = None,
) -> torch.Tensor:
    """decode_attention over a padded batch: q [B, H, D] -> [B, H*D]."""
    b, h, d = q.shape
    length = max(meta.kv_lens)
    k = _gather_kv(k_pool, meta.block_tables, length)  # [B, L, KVH, D]
    v = _gather_kv(v_pool, meta.block_tables, length)
    kvh = k.shape[2]
    qg = q.view(b, kvh, h // kvh, d)  # [B, KVH, G, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [B, KVH, G, L]
    if slopes is not None:
        lens = torch.tensor(meta.kv_lens, device=q.device)
        rel = torch.arange(length, device=q.device)[None, :] - (lens[:, None] - 1)  # [B, L]
        scores = scores + (slopes.view(1, kvh, h // kvh, 1) * rel[:, None, None, :]).to(scores.dtype)
    if key_bias is not None:
        kb = key_bias(torch.arange(length, device=q.device))  # [H, L]
        scores = scores + kb.view(1, kvh, h // kvh, length).to(scores.dtype)
    padding = meta.decode_padding(length, q.device)  # [B, L] or None
    if padding is not None:
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
        v = v.masked_fill(padding[:, :, None, None], 0.0)  # 0 * garbage could be NaN
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [B, KVH, G, D]
    return out.reshape(b, h * d).to(q.dtype)


def compiled_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when a sequence's causal prefill attention runs the compiled CPU kernel
    (core.kernels.cpu.ops.prefill_attention: bfloat16 on the vector builds)."""
    return (q.dtype == torch.bfloat16 and not q.requires_grad and dispatch.use_cpu_kernels(q)
            and dispatch.cpu_ops().prefill_attention_fits(q, k, v))


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
    k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, slopes: torch.Tensor | None,
    key_bias: KeyBias | None = None,
) -> torch.Tensor:
    """Packed sequences with any number of new tokens: q [T, H, D] -> [T, H*D]."""
    outs = []
    start = 0
    for i, (n, ctx) in enumerate(zip(meta.seq_lens, meta.context_lens)):
        qi = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
        if ctx == 0:
            ki, vi = k[start : start + n], v[start : start + n]  # [n, KVH, D]
        else:
            table = meta.block_tables[i : i + 1]
            first = meta.contiguous_from[i] if meta.contiguous_from else None
            ki, vi = _gather_kv(k_pool, table, ctx + n, first)[0], _gather_kv(v_pool, table, ctx + n, first)[0]
        ki, vi = ki.to(q.dtype), vi.to(q.dtype)  # [L, KVH, D]
        prefix = meta.prefix_lens[i] if meta.prefix_lens else 0
        simple = slopes is None and key_bias is None and (meta.mask == "causal" or prefix <= 1)
        if simple and compiled_prefill(q, ki, vi):  # the compiled kernel (docs/runtime.md: against torch's SDPA)
            outs.append(dispatch.cpu_ops().prefill_attention(q[start : start + n], ki, vi, scale))
            start += n
            continue
        ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]  # [1, KVH, L, D]
        if simple and ctx == 0 and not half_on_cpu(q):
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            bias = _mask_bias(n, ctx, meta.mask, prefix, slopes, q.dtype, q.device, key_bias)[None]  # [1, H|1, n, L]
            ki, vi, bias = whole_key_blocks(ki, vi, bias)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=bias, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


SDPA_KV_BLOCK = 512  # keys per block of torch's CPU flash attention (its kvSplitSize): blocks start at key 0


def half_on_cpu(q: torch.Tensor) -> bool:
    """True for bfloat16 / float16 queries on the CPU: their SDPA runs on whole key blocks (whole_key_blocks)."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)


def whole_key_blocks(
    ki: torch.Tensor, vi: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Half-precision CPU queries (half_on_cpu): keys and values [1, KVH, L, D] padded with zeros to
    L' = SDPA_KV_BLOCK ceil(L / SDPA_KV_BLOCK), the additive mask [..., n, L] with -inf over the padding.
    torch's CPU flash attention then sums every key block of a query row over SDPA_KV_BLOCK keys (its
    GEMM's reduction length), whatever the step's L: a row comes out the same whether its prompt is
    computed whole, in chunks or after a reused prefix (measured: not so on L keys). Other inputs: as given."""
    length = ki.shape[2]
    padded = -(-length // SDPA_KV_BLOCK) * SDPA_KV_BLOCK
    if padded == length or ki.device.type != "cpu" or ki.dtype not in (torch.bfloat16, torch.float16):
        return ki, vi, bias
    extra = padded - length
    return (F.pad(ki, (0, 0, 0, extra)), F.pad(vi, (0, 0, 0, extra)),
            F.pad(bias, (0, extra), value=float("-inf")))  # [1, KVH, L', D] x2, [..., n, L']


def aligned_keys(q_first: int, q_last: int, window: int, sinks: int) -> tuple[torch.Tensor, slice]:
    """The keys windowed_attention gathers for queries q_first..q_last: cache positions [K] ascending, the
    sinks s = min(S, lo) then a .. q_last, lo = first_key(q_first) (visible_keys: the sinks, then lo ..),
    with a = s + SDPA_KV_BLOCK floor((lo - s) / SDPA_KV_BLOCK) <= lo; and the slice of the keys a .. lo - 1,
    which no query of these sees. Key j then sits at index j mod SDPA_KV_BLOCK of an SDPA key block
    whatever q_first, so a query's sums run in the same order whether its prompt is computed whole, in
    chunks or after a reused prefix (batch invariance)."""
    keys = visible_keys(q_first, q_last, window, sinks)  # [K]: the sinks s, then lo .. q_last
    lo = first_key(q_first, window, sinks)
    s = keys.numel() - (q_last + 1 - lo)  # sinks gathered before the rolling part
    a = s + (lo - s) // SDPA_KV_BLOCK * SDPA_KV_BLOCK
    if a == lo:
        return keys, slice(s, s)
    return torch.cat([keys[:s], torch.arange(a, q_last + 1)]), slice(s, s + lo - a)


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
    k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, slopes: torch.Tensor | None,
    key_bias: KeyBias | None, windows: list[int], sinks: list[int], softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """prefill_attention / decode_attention under per-sequence windows (core.kernels.attention_window):
    q [T, H, D] -> [T, H*D]. Each sequence gathers only the keys its queries may see (sink tokens +
    the rolling part: released blocks are never read) and masks the rest per query; `softcap` and
    `sink_logits` [H] (per-head logits, not sink tokens): see capped_attention."""
    outs, start, bs = [], 0, meta.block_size
    for i, (n, ctx) in enumerate(zip(meta.seq_lens, meta.context_lens)):
        k_pos, dead = aligned_keys(ctx, ctx + n - 1, windows[i], sinks[i])  # [K]
        k_pos = k_pos.to(q.device)
        if ctx == 0:  # a fresh prompt: its keys are this step's
            ki, vi = k[start : start + n][k_pos], v[start : start + n][k_pos]  # [K, KVH, D]
        else:
            slots = meta.block_tables[i, k_pos // bs] * bs + k_pos % bs  # [K]
            ki = k_pool.view(-1, *k_pool.shape[2:]).index_select(0, slots)
            vi = v_pool.view(-1, *v_pool.shape[2:]).index_select(0, slots)
            ki[dead], vi[dead] = 0, 0  # keys no query here sees, maybe in released blocks: finite, masked
        q_pos = torch.arange(ctx, ctx + n, device=q.device)  # [n]
        prefix = meta.prefix_lens[i] if meta.prefix_lens and meta.mask == "prefix_lm" else 0
        visible = window_visible(q_pos, k_pos, windows[i], sinks[i], prefix)  # [n, K]
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device).masked_fill_(~visible, float("-inf"))
        bias = bias[None]  # [1, n, K]
        if slopes is not None:
            bias = bias + slopes.to(q.device)[:, None, None] * (k_pos[None, :] - q_pos[:, None])[None].float()
        if key_bias is not None:
            bias = bias + key_bias(k_pos)[:, None, :]  # [H, 1, K]
        qi = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
        ki, vi = ki.transpose(0, 1)[None].to(q.dtype), vi.transpose(0, 1)[None].to(q.dtype)  # [1, KVH, K, D]
        o = _attend(qi, ki, vi, bias, scale, softcap, sink_logits)  # [1, H, n, D]
        outs.append(o[0].transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _attend(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, bias: torch.Tensor, scale: float,
            softcap: float | None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(s + bias) v, s = q k^T * scale, or c tanh(s / c) with softcap c (float32); with sink logits
    a [H] the softmax's denominator gains exp(a_h), a term with no value (module doc):
    qi [1, H, n, D], ki / vi [1, KVH, K, D], bias [H or 1, n, K] -> [1, H, n, D]."""
    if softcap is None and sink_logits is None:
        ki, vi, mask = whole_key_blocks(ki, vi, bias.to(qi.dtype)[None])  # [1, KVH, K', D] x2, [1, H|1, n, K']
        return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
    group = qi.shape[1] // ki.shape[1]
    kf, vf = ki.float().repeat_interleave(group, 1), vi.float().repeat_interleave(group, 1)  # [1, H, K, D]
    s = torch.matmul(qi.float(), kf.transpose(-1, -2)) * scale  # [1, H, n, K]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s + bias.float()[None]
    if sink_logits is None:
        return torch.matmul(torch.softmax(s, dim=-1), vf).to(qi.dtype)  # [1, H, n, D]
    sink = sink_logits.float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)  # [1, H, n, 1]
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]  # [1, H, n, K]: the sink's share dropped
    return torch.matmul(p, vf).to(qi.dtype)  # [1, H, n, D]


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
    k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, slopes: torch.Tensor | None,
    key_bias: KeyBias | None, bounds: tuple[list[int], list[int]] | None, softcap: float | None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention on explicit float32 scores, any step (prefill, decode, cached context, windows `bounds`
    or none), with a soft-cap c and / or sink logits a [H] (this rank's heads):

        s_ij = c tanh(scale q_i . k_j / c) + bias_ij      (scale q_i . k_j + bias_ij without a cap)
        out_i = sum_j exp(s_ij) / (exp(a_h) + sum_j' exp(s_ij')) v_j      (no exp(a_h) without sinks)

    q [T, H, D] -> [T, H*D]; bias: ALiBi / key bias, -inf on the keys query i does not see (causal,
    prefix, window)."""
    b = len(meta.seq_lens)
    windows, sinks = bounds if bounds is not None else ([0] * b, [0] * b)  # 0: attention_window.FULL
    return windowed_attention(q, k, v, meta, k_pool, v_pool, scale, slopes, key_bias, windows, sinks, softcap,
                              sink_logits)


def sequences(meta: AttentionMetadata, seqs: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata of sequences `seqs` of this step alone, and their tokens' indices [T'] in the step."""
    starts = [0, *torch.tensor(meta.seq_lens).cumsum(0).tolist()]
    tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs]).to(meta.slot_mapping.device)

    def pick(xs):  # a per-sequence list's entries of seqs (None / [] as they are)
        return [xs[i] for i in seqs] if xs else xs

    sub = AttentionMetadata(
        positions=meta.positions[..., tokens], seq_lens=pick(meta.seq_lens), context_lens=pick(meta.context_lens),
        block_tables=meta.block_tables[seqs], slot_mapping=meta.slot_mapping[tokens], block_size=meta.block_size,
        mask=meta.mask, prefix_lens=pick(meta.prefix_lens), windows=pick(meta.windows), sinks=pick(meta.sinks),
        contiguous_from=pick(meta.contiguous_from))
    return sub, tokens


def decode_rows_apart(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
    k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, slopes: torch.Tensor | None,
    key_bias: KeyBias | None, bounds: tuple[list[int], list[int]] | None, attend: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """A step mixing sequences with one new token and longer ones, q [T, H, D] -> [T, H*D]: the one-token
    rows attended as a decode step of them alone would (the compiled decode kernel where
    dispatch.paged_attention would take it, else `attend`, core.kernels.attention.paged_attention_ref, on a
    decode step), the others by `attend` on a step of them alone. Each kernel sums a row's keys in an order
    fixed by the row's sequence, so a decode row's result is the same whatever shares its step."""
    ones = [i for i, n in enumerate(meta.seq_lens) if n == 1]
    rest = [i for i, n in enumerate(meta.seq_lens) if n != 1]
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)  # [T, H*D]
    for seqs in (ones, rest):
        sub, tokens = sequences(meta, seqs)
        part = None if bounds is None else ([bounds[0][i] for i in seqs], [bounds[1][i] for i in seqs])
        if seqs is ones and dispatch._cpu_decode_step(q, sub, key_bias) and dispatch.use_cpu_kernels(k_pool):
            kv_lens = torch.tensor(sub.kv_lens, dtype=torch.int64)
            rows = dispatch.cpu_ops().decode_attention(q[tokens], k_pool, v_pool, sub.block_tables, kv_lens, scale,
                                                       slopes, None, part)  # [B1, H*D]
        else:
            rows = attend(q[tokens], k[tokens], v[tokens], sub, k_pool, v_pool, scale, slopes, key_bias, part)
        out[tokens] = rows.to(out.dtype)
    return out
