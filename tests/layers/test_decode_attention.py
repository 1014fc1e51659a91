"""Decode attention: the CPU per-sequence path equals the padded batch path and a dense reference."""

from __future__ import annotations

import pytest
import torch

from bestiary.core.kernels.attention_ref import _decode_padded, decode_attention
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.layers.attention import alibi_slopes


def _setup(dtype):
    g = torch.Generator().manual_seed(0)
    block, kvh, h, d = 4, 2, 6, 8
    k_pool = torch.full((12, block, kvh, d), float("nan"), dtype=dtype)  # never-written slots: NaN
    v_pool = torch.full((12, block, kvh, d), float("nan"), dtype=dtype)
    lens = [5, 9, 1]
    tables = [[3, 4], [0, 7, 8], [10]]  # seq 0 and 2 contiguous, seq 1 not
    for length, table in zip(lens, tables):
        for j in range(length):
            k_pool[table[j // block], j % block] = torch.randn(kvh, d, generator=g).to(dtype)
            v_pool[table[j // block], j % block] = torch.randn(kvh, d, generator=g).to(dtype)
    meta = AttentionMetadata.build([1] * 3, [n - 1 for n in lens], tables, block)
    q = torch.randn(3, h, d, generator=g).to(dtype)
    return q, meta, k_pool, v_pool, lens, tables


def _dense(q, k_pool, v_pool, lens, tables, scale, slopes):
    outs = []
    for i, (length, table) in enumerate(zip(lens, tables)):
        k = torch.cat([k_pool[b] for b in table])[:length].float()  # [L, KVH, D]
        v = torch.cat([v_pool[b] for b in table])[:length].float()
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [L, H, D]
        s = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        if slopes is not None:
            s = s + slopes[:, None] * (torch.arange(length) - (length - 1))[None]
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v).reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sequence_equals_padded_and_dense(dtype, alibi):
    q, meta, k_pool, v_pool, lens, tables = _setup(dtype)
    slopes = alibi_slopes(q.shape[1]) if alibi else None
    out = decode_attention(q, meta, k_pool, v_pool, 0.35, slopes)
    assert out.shape == (3, q.shape[1] * q.shape[2]) and out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = _dense(q, k_pool, v_pool, lens, tables, 0.35, slopes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    if dtype == torch.float32:  # the padded path (non-CPU devices) agrees, NaN garbage masked
        torch.testing.assert_close(_decode_padded(q, meta, k_pool, v_pool, 0.35, slopes), out, rtol=1e-5, atol=1e-5)
