"""activations: act(f) * g for the gated MLPs and plain act, every supported activation."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import ALL_DTYPES, assert_close, assert_far

from bestiary.core.format.errors import ConfigError
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.activations_ref import ACT_CODES, ACTIVATIONS
from bestiary.core.layers.mlp import MLP, GatedMLP

acts = dispatch.family("activations")


def test_every_layer_activation_has_a_kernel():
    assert set(ACTIVATIONS) == set(ACT_CODES)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("width", [96, 129, 300])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_new", "relu"])
def test_act_and_mul_on_fused_halves(act, width, dtype, device):
    """f, g are the two halves of one [T, 2I] matmul output (row stride 2I)."""
    fg = (torch.randn(3, 2 * width) * 3).to(dtype).to(device)
    f, g = fg.chunk(2, dim=-1)
    assert_close(acts.act_and_mul(f, g, act), acts.act_and_mul_ref(f, g, act), dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_plain_activation(act, dtype, device):
    x = (torch.randn(3, 129) * 4).to(dtype).to(device)
    assert_close(acts.activation(x, act), acts.activation_ref(x, act), dtype)


def test_large_inputs_saturate(device):
    """tanh-gelu and silu far out in both tails: no inf / nan from exp overflow."""
    x = torch.tensor([[-100.0, -30.0, -5.0, 0.0, 5.0, 30.0, 100.0]]).to(device)
    for act in ("silu", "gelu_new", "gelu"):
        assert_close(acts.activation(x, act), acts.activation_ref(x, act), torch.float32)


def test_unknown_activation_is_refused(device):
    with pytest.raises(ConfigError, match="no Triton kernel"):
        acts.activation(torch.randn(2, 4).to(device), "mish")


def test_mlp_layers_dispatch(device):
    x = torch.randn(3, 96).to(device)
    for layer in (GatedMLP(96, 129, "silu", False, 0, 1, torch.float32), MLP(96, 129, "gelu", True, 0, 1, torch.float32)):
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape) / 10)
        layer = layer.to(device)
        with dispatch.kernels_mode("torch"):
            ref = layer(x)
        with dispatch.kernels_mode("triton"):
            out = layer(x)
        assert_close(out, ref, torch.float32)


def test_broken_variant_misses(device):
    fg = torch.randn(3, 2 * 129).to(device)
    f, g = fg.chunk(2, dim=-1)
    assert_far(acts.act_and_mul(f, g, "relu"), acts.act_and_mul_ref(f, g, "gelu"), torch.float32)
