"""norms: rms_norm, layer_norm (with / without bias), fused residual add + norm."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import ALL_DTYPES, assert_close, assert_far

from bestiary.core.kernels import dispatch
from bestiary.core.layers.norm import LayerNorm, RMSNorm

norms = dispatch.family("norms")
HIDDEN = [96, 129, 300]


def _inputs(hidden: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = (torch.randn(5, hidden) * 3 + 0.5).to(dtype).to(device)
    res = torch.randn(5, hidden).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype).to(device)
    b = (0.1 * torch.randn(hidden)).to(dtype).to(device)
    return x, res, w, b


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm(hidden, dtype, device):
    x, _, w, _ = _inputs(hidden, dtype, device)
    assert_close(norms.rms_norm(x, w, 1e-6), norms.rms_norm_ref(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm(hidden, dtype, with_bias, device):
    x, _, w, b = _inputs(hidden, dtype, device)
    b = b if with_bias else None
    assert_close(norms.layer_norm(x, w, b, 1e-5), norms.layer_norm_ref(x, w, b, 1e-5), dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("kind", ["rms", "layer", "layer_no_bias"])
def test_fused_add_norm(kind, dtype, device):
    x, res, w, b = _inputs(129, dtype, device)
    b = None if kind == "layer_no_bias" else b
    if kind == "rms":
        (y, h), (y_ref, h_ref) = norms.add_rms_norm(x, res, w, 1e-6), norms.add_rms_norm_ref(x, res, w, 1e-6)
    else:
        (y, h), (y_ref, h_ref) = norms.add_layer_norm(x, res, w, b, 1e-5), norms.add_layer_norm_ref(x, res, w, b, 1e-5)
    assert_close(h, h_ref, dtype)
    assert_close(y, y_ref, dtype)


def test_strided_rows_and_3d_input(device):
    """A [T, 2H] view's halves (row stride 2H) and a [2, T, H] input take the kernel too."""
    xx = torch.randn(2, 4, 2 * 96).to(device)
    x = xx[..., :96]
    w = torch.randn(96).to(device)
    assert_close(norms.rms_norm(x, w, 1e-6), norms.rms_norm_ref(x, w, 1e-6), torch.float32)


def test_layers_dispatch_to_kernel_and_reference(device):
    """RMSNorm / LayerNorm modules: forced Triton == torch path, and add_and_norm == norm(x + r)."""
    rms, ln = RMSNorm(129, 1e-6), LayerNorm(129, 1e-5, bias=True)
    with torch.no_grad():
        for p in (*rms.parameters(), *ln.parameters()):
            p.copy_(1 + 0.1 * torch.randn(p.shape))
    rms, ln = rms.to(device), ln.to(device)
    x, res = torch.randn(3, 129).to(device), torch.randn(3, 129).to(device)
    for layer in (rms, ln):
        with dispatch.kernels_mode("torch"):
            ref, (y_ref, h_ref) = layer(x), layer.add_and_norm(x, res)
            again = layer(h_ref)
        with dispatch.kernels_mode("triton"):
            out, (y, h) = layer(x), layer.add_and_norm(x, res)
        assert_close(out, ref, torch.float32)
        assert_close(y, layer(x + res), torch.float32)
        assert torch.equal(h, h_ref) and torch.equal(y_ref, again)


def test_broken_variant_misses(device):
    """rms_norm against the layer_norm reference (centering dropped) misses by far."""
    x, _, w, _ = _inputs(129, torch.float32, device)
    assert_far(norms.rms_norm(x, w, 1e-6), norms.layer_norm_ref(x, w, None, 1e-6), torch.float32)
