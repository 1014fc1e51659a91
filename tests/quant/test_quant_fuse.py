"""Fused quantized fc + gate (core.quant.fuse) equal the two layers run apart, in every layout."""

from __future__ import annotations

import pytest
import torch

from bestiary.core.kernels import dispatch
from bestiary.core.layers.linear import Linear
from bestiary.core.quant.fuse import fuse_quantized
from bestiary.core.quant.modes import LinearQuant
from bestiary.core.quant.slot import WeightOnlySlot

LAYOUTS = {
    "int8": LinearQuant("W8A16", 8),
    "int4_g64": LinearQuant("W4A16", 4, 64),
    "int4_g32_zp": LinearQuant("W4A16", 4, 32, True),
}


def _quantized_linear(lq: LinearQuant, n: int, k: int, seed: int) -> Linear:
    lin = Linear(k, n)
    lin.name = f"layer{seed}"
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    slot = WeightOnlySlot.install(lin, lq)
    for name, t in slot.quantize(w, torch.float32).items():
        setattr(lin, name, torch.nn.Parameter(t, requires_grad=False))
    return lin


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tokens", [1, 3, 20])  # kernel path (<= 8 tokens) and dequantize path
def test_fused_equals_members(layout, tokens):
    lq = LAYOUTS[layout]
    fc, gate = _quantized_linear(lq, 128, 96, 1), _quantized_linear(lq, 64, 96, 2)
    ref = [m.quant.dequantize(m) for m in (fc, gate)]  # [N, K] float32, before any repacking
    fused = fuse_quantized([fc, gate])
    assert fused is not None
    for m in (fc, gate):
        m.quant.prepare(m)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(3))
    y = fused(x)  # [T, 192]
    apart = torch.cat([fc(x), gate(x)], dim=-1)
    torch.testing.assert_close(y, apart, rtol=0, atol=0)
    exact = torch.cat([x @ r.t() for r in ref], dim=-1)
    torch.testing.assert_close(y, exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())  # bf16 compute
    # members hold views of the fused tensors: nothing is stored twice
    assert fc.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


def test_unfusable_layers_are_left_alone():
    a = _quantized_linear(LAYOUTS["int8"], 64, 96, 1)
    b = _quantized_linear(LAYOUTS["int4_g64"], 64, 96, 2)
    assert fuse_quantized([a, b]) is None  # different layouts
    c = _quantized_linear(LAYOUTS["int4_g64"], 40, 96, 3)  # 40 rows: not on a block of aten's CPU int4 layout
    with dispatch.kernels_mode("torch"):  # (the compiled kernels read the checkpoint layout: any rows)
        assert fuse_quantized([b, c]) is None
