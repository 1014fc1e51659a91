"""Sliding-window attention with sinks in the torch reference and the Triton kernels.

Each case is checked against a dense brute-force attention that masks with the definition
(j <= q and (j < S or q - j < W - S)) over every key of the sequence. The blocks no query of
the step may see are then filled with NaN, as released blocks hold whatever their next owner
wrote: an op that reads one returns NaN.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import assert_close, paged_inputs

from bestiary.core.kernels import dispatch
from bestiary.core.kernels.attention_window import releasable_blocks
from bestiary.core.kernels.metadata import AttentionMetadata

attention = dispatch.family("attention")
BLOCK_SIZE = 5

# (seq_lens, ctx_lens, windows, sinks): fresh prompts, chunks after a long context, decodes
CASES = [
    ([23, 1, 9], [0, 0, 40], [7, 0, 12], [0, 0, 3]),  # windowed prompt, plain, chunk with sinks
    ([17, 30], [0, 11], [17, 9], [4, 2]),  # window == prompt, sinks inside a block
    ([1, 1, 1, 1], [63, 5, 40, 29], [16, 60, 8, 0], [4, 4, 0, 0]),  # decodes: window > length, sinks, none
    ([20], [90], [70], [4]),  # window wider than the key tile (64)
]


def dense_reference(q, k_all, v_all, seq_lens, ctx_lens, windows, sinks, scale):
    """softmax over masked dense scores per sequence and head: q [T, H, D], k_all/v_all lists of [L, KVH, D]."""
    outs, start = [], 0
    h = q.shape[1]
    for n, ctx, kk, vv, w, s in zip(seq_lens, ctx_lens, k_all, v_all, windows, sinks):
        g = h // kk.shape[1]
        kk, vv = kk.float().repeat_interleave(g, 1), vv.float().repeat_interleave(g, 1)  # [L, H, D]
        mask = torch.zeros(n, ctx + n, dtype=torch.bool)
        for i in range(n):
            qp = ctx + i
            for j in range(ctx + n):
                mask[i, j] = j <= qp and (w == 0 or j < s or qp - j < w - s)
        scores = torch.einsum("nhd,lhd->hnl", q[start : start + n].float(), kk) * scale
        probs = scores.masked_fill(~mask, -math.inf).softmax(-1)
        outs.append(torch.einsum("hnl,lhd->nhd", probs, vv).reshape(n, -1))
        start += n
    return torch.cat(outs)


def setup_case(seq_lens, ctx_lens, windows, sinks, h, kvh, d, device):
    """(q, k, v, meta, k_pool, v_pool, dense reference) with the never-seen blocks poisoned."""
    q, k, v, meta, k_pool, v_pool = paged_inputs(seq_lens, ctx_lens, h, kvh, d, torch.float32, device, BLOCK_SIZE)
    meta.windows, meta.sinks = windows, sinks
    tables = meta.block_tables.cpu()
    flat_k, flat_v = k_pool.flatten(0, 1).cpu(), v_pool.flatten(0, 1).cpu()
    slots = [tables[i, torch.arange(c + n) // BLOCK_SIZE] * BLOCK_SIZE + torch.arange(c + n) % BLOCK_SIZE
             for i, (n, c) in enumerate(zip(seq_lens, ctx_lens))]
    ref = dense_reference(q.cpu(), [flat_k[s] for s in slots], [flat_v[s] for s in slots], seq_lens, ctx_lens,
                          windows, sinks, d**-0.5)
    for i, (ctx, w, s) in enumerate(zip(ctx_lens, windows, sinks)):
        for b in releasable_blocks(ctx, w, s, BLOCK_SIZE):
            k_pool[tables[i, b]], v_pool[tables[i, b]] = float("nan"), float("nan")
    return q, k, v, meta, k_pool, v_pool, ref


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("h,kvh", [(4, 2), (3, 1)])
def test_windowed_attention_matches_dense_mask(case, h, kvh, device):
    """Torch reference and Triton kernel == dense masked attention; released blocks never read."""
    q, k, v, meta, kp, vp, ref = setup_case(*CASES[case], h, kvh, 24, device)
    bounds = meta.window_bounds(0)
    out_ref = attention.paged_attention_ref(q, k, v, meta, kp, vp, 24**-0.5, None, None, bounds)
    assert_close(out_ref.cpu(), ref, torch.float32)
    out = attention.paged_attention(q, k, v, meta, kp, vp, 24**-0.5, None, None, bounds)
    assert_close(out.cpu(), ref, torch.float32)


def test_layer_window_narrows_the_sequence_window(device):
    """A layer window of 6 under a sequence window of 12 (sinks 2) is a window of 6 with those sinks."""
    q, k, v, meta, kp, vp, ref = setup_case([9, 1], [0, 30], [6, 6], [2, 2], 4, 2, 16, device)
    meta.windows = [12, 0]  # the second sequence has no window of its own: the layer's alone, with its sinks
    assert meta.window_bounds(6) == ([6, 6], [2, 2])
    out = attention.paged_attention(q, k, v, meta, kp, vp, 16**-0.5, None, None, meta.window_bounds(6))
    assert_close(out.cpu(), ref, torch.float32)


def test_no_window_anywhere_is_plain_attention(device):
    """window_bounds is None (the unwindowed kernels run) when neither layer nor sequence has a window."""
    meta = AttentionMetadata.build([3], [0], [[0]], BLOCK_SIZE, device=device)
    assert meta.window_bounds(0) is None
    meta.windows, meta.sinks = [0], [0]
    assert meta.window_bounds(0) is None
    assert meta.window_bounds(4) == ([4], [0])
