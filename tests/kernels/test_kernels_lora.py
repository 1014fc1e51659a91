"""LoRA SGMV / BGMV: per-sequence adapters with different ranks in one batched op."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DOT_DTYPES, assert_close, assert_far

from bestiary.core.kernels import dispatch
from bestiary.core.layers.linear import Linear

lora = dispatch.family("lora")
K, N = 96, 129


def _adapters(dtype, device, ranks=(8, 4, 6)):
    r_max = max(ranks)
    a = (torch.randn(len(ranks), r_max, K) / K**0.5).to(dtype).to(device)
    b = (torch.randn(len(ranks), N, r_max) / r_max**0.5).to(dtype).to(device)
    for i, r in enumerate(ranks):  # padding past the rank is garbage: the kernels must mask it
        a[i, r:] = 100.0
        b[i, :, r:] = 100.0
    as_int = dict(dtype=torch.int32, device=device)
    return a, b, torch.tensor(ranks, **as_int), torch.tensor([0.5, 2.0, 1.0], device=device)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("seg_lens,adapters", [([4, 1, 19], [1, -1, 0]), ([1, 1, 1, 1], [2, 0, -1, 2])])
def test_sgmv(seg_lens, adapters, dtype, device):
    """Prefill segments (SGMV) and one-token decode segments (BGMV); -1 = no adapter."""
    a, b, ranks, scalings = _adapters(dtype, device)
    x = torch.randn(sum(seg_lens), K).to(dtype).to(device)
    starts = torch.tensor([0, *torch.tensor(seg_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seg_adapters = torch.tensor(adapters, dtype=torch.int32, device=device)
    out = lora.lora_sgmv(x, a, b, starts, seg_adapters, ranks, scalings, block_n=32, block_k=32)
    ref = lora.lora_sgmv_ref(x, a, b, starts, seg_adapters, ranks, scalings)
    assert_close(out, ref, dtype)
    none = [i for i, ad in enumerate(adapters) if ad < 0]
    for i in none:
        assert not out[starts[i] : starts[i + 1]].any(), "a segment without adapter must get a zero delta"


def test_broken_variant_misses(device):
    """Each segment given its neighbour's adapter."""
    a, b, ranks, scalings = _adapters(torch.float32, device)
    x = torch.randn(6, K).to(device)
    starts = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    out = lora.lora_sgmv(x, a, b, starts, torch.tensor([1, 0], dtype=torch.int32, device=device), ranks, scalings)
    ref = lora.lora_sgmv_ref(x, a, b, starts, torch.tensor([0, 1], dtype=torch.int32, device=device), ranks, scalings)
    assert_far(out, ref, torch.float32)


def test_step_lora_sgmv_equals_the_masked_dense_path(device):
    """core.lora's StepLora: the SGMV kernels (B pre-scaled, adapters padded to the largest rank) and the
    CPU path (rank-concatenated A / B and a per-token scale mask) give the same deltas, for a site of two
    linears side by side with two pieces each, adapters of ranks 2+3 and 5+0, and base tokens."""
    from bestiary.core.lora.adapter import LoraAdapter, LoraPiece
    from bestiary.core.lora.batch import AdapterStack, StepLora

    fc, gate = Linear(K, 40), Linear(K, 24)
    fc.name, gate.name = "transformer.layers.0.mlp.fc", "transformer.layers.0.mlp.gate"

    def piece(out_f: int, r: int, s: float) -> LoraPiece:
        return LoraPiece("x", torch.randn(r, K).to(device), torch.randn(out_f, r).to(device), s)

    one = LoraAdapter("one", None, {(fc.name, -1): [piece(40, 2, 0.5)], (gate.name, -1): [piece(24, 3, 2.0)]})
    two = LoraAdapter("two", None, {(fc.name, -1): [piece(40, 5, 1.5)]})
    x = torch.randn(7, K).to(device)
    with dispatch.kernels_mode("triton"):
        stack = AdapterStack([one, two], torch.float32, device)
        step = StepLora(stack, [3, 1, 2, 1], [1, -1, 0, 1])
        kernel = step.concat((fc, gate), x)
    with dispatch.kernels_mode("torch"):
        dense = step.concat((fc, gate), x)
    want = torch.zeros(7, 64, device=device)
    for rows, adapter in ((slice(0, 3), two), (slice(4, 6), one), (slice(6, 7), two)):
        for (name, _), pieces in adapter.pieces.items():
            cols = slice(0, 40) if name == fc.name else slice(40, 64)
            for p in pieces:
                want[rows, cols] += p.scaling * x[rows] @ p.a.t() @ p.b.t()
    assert_close(dense, want, torch.float32)
    assert_close(kernel, want, torch.float32)
    assert not dense[3].any(), "a base token gets no delta"
