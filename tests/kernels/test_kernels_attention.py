"""attention: packed varlen prefill and paged decode (GQA / MQA, alibi, key bias, prefix-LM).

Pools are [num_blocks, block_size, KVH, D] with block_size 5, which divides neither the
kernels' key tile (16) nor the sequence lengths; block tables are shuffled and every
unused slot holds garbage, so reading past a sequence shows.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DOT_DTYPES, assert_close, assert_far
from kernel_helpers import paged_inputs as _setup

from bestiary.core.kernels import dispatch
from bestiary.core.layers.attention import alibi_slopes

attention = dispatch.family("attention")
BLOCK_SIZE = 5
HEADS = [(3, 1), (4, 2), (3, 3)]  # (H, KVH): MQA, GQA, MHA


def _both(q, k, v, meta, k_pool, v_pool, scale, slopes=None, key_bias=None, **blocks):
    ref = attention.paged_attention_ref(q, k, v, meta, k_pool, v_pool, scale, slopes, key_bias)
    run = attention.decode if meta.is_decode else attention.prefill
    return run(q, meta, k_pool, v_pool, scale, slopes, key_bias, **blocks), ref


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("h,kvh", HEADS)
@pytest.mark.parametrize("alibi", [False, True])
def test_prefill_packed_varlen(h, kvh, alibi, dtype, device):
    """Three sequences: a fresh prompt, a one-token prompt and a chunk after 20 cached tokens."""
    q, k, v, meta, kp, vp = _setup([5, 1, 9], [0, 0, 20], h, kvh, 24, dtype, device)
    slopes = alibi_slopes(h).to(device) if alibi else None
    out, ref = _both(q, k, v, meta, kp, vp, 24**-0.5, slopes, block_m=16, block_n=16)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_prefill_prefix_lm(dtype, device):
    """ChatGLM v1's mask: bidirectional over the first prefix_len tokens, causal after."""
    q, k, v, meta, kp, vp = _setup([7, 6], [0, 0], 3, 1, 32, dtype, device, mask="prefix_lm", prefix_lens=[4, 6])
    out, ref = _both(q, k, v, meta, kp, vp, 32**-0.5, block_m=16, block_n=16)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("h,kvh", HEADS)
@pytest.mark.parametrize("alibi", [False, True])
def test_decode_paged(h, kvh, alibi, dtype, device):
    """Three sequences with 0, 6 and 22 cached tokens, one new token each."""
    q, k, v, meta, kp, vp = _setup([1, 1, 1], [0, 6, 22], h, kvh, 24, dtype, device)
    slopes = alibi_slopes(h).to(device) if alibi else None
    out, ref = _both(q, k, v, meta, kp, vp, 24**-0.5, slopes, block_n=16)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("decode", [False, True])
def test_key_bias(decode, device):
    """An architecture's key-position bias [H, L] (Falcon's ALiBi form)."""
    seq, ctx = ([1, 1], [4, 11]) if decode else ([6, 3], [0, 8])
    q, k, v, meta, kp, vp = _setup(seq, ctx, 4, 2, 16, torch.float32, device)
    slopes = alibi_slopes(4).to(device)

    def key_bias(k_pos: torch.Tensor) -> torch.Tensor:
        return slopes[:, None] * k_pos[None, :].float()

    out, ref = _both(q, k, v, meta, kp, vp, 0.25, key_bias=key_bias, block_n=16)
    assert_close(out, ref, torch.float32)


def test_dispatch_picks_decode_or_prefill(device):
    q, k, v, meta, kp, vp = _setup([1, 1], [3, 9], 3, 1, 32, torch.float32, device)
    with dispatch.kernels_mode("triton"):
        out = dispatch.paged_attention(q, k, v, meta, kp, vp, 0.2, None)
    assert_close(out, attention.paged_attention_ref(q, k, v, meta, kp, vp, 0.2, None), torch.float32)


@pytest.mark.parametrize("decode", [False, True])
def test_broken_variant_misses(decode, device):
    """The kernel at twice the softmax scale."""
    seq, ctx = ([1, 1], [4, 11]) if decode else ([6, 3], [0, 8])
    q, k, v, meta, kp, vp = _setup(seq, ctx, 3, 1, 32, torch.float32, device)
    run = attention.decode if decode else attention.prefill
    out = run(q, meta, kp, vp, 2 * 32**-0.5)
    assert_far(out, attention.paged_attention_ref(q, k, v, meta, kp, vp, 32**-0.5, None), torch.float32)
