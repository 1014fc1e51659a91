"""rotary: neox / gptj, partial rot_dim, packed positions, strided q/k views of a fused qkv."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import ALL_DTYPES, assert_close, assert_far

from bestiary.core.kernels import dispatch
from bestiary.core.layers.rotary import Rotary

rotary = dispatch.family("rotary")

# Two packed sequences: positions 5..9 (a continued sequence) and 0..3.
POSITIONS = torch.tensor([5, 6, 7, 8, 9, 0, 1, 2, 3])


def _qkv(head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[T, H + 2 KVH, D] with H = 3, KVH = 1: rotate the strided view of its first 4 heads."""
    return torch.randn(len(POSITIONS), 5, head_dim).to(dtype).to(device)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rot_dim", [(32, 32), (96, 48), (30, 14)])
def test_apply_rotary(head_dim, rot_dim, style, dtype, device):
    rot = Rotary(head_dim, rot_dim, 10000.0, None, 64, style=style)
    pos = POSITIONS.to(device)
    cos, sin = rot.cos_sin(pos, dtype)
    qkv = _qkv(head_dim, dtype, device)
    out, ref = qkv.clone(), qkv.clone()
    rotary.apply_rotary(out[:, :4], cos, sin, rot_dim, style)
    rotary.apply_rotary_ref(ref[:, :4], cos, sin, rot_dim, style)
    assert_close(out, ref, dtype)
    assert torch.equal(out[:, 4:], qkv[:, 4:]), "the v head must stay untouched"
    assert torch.equal(out[..., rot_dim:], qkv[..., rot_dim:]), "dims past rot_dim must stay untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rot_dim", [(32, 32), (30, 14)])
def test_rotary_embedding_reads_positions(head_dim, rot_dim, style, dtype, device):
    """The table form: positions index cos_sin [P, rot_dim] inside the kernel (partial rotary too)."""
    rot = Rotary(head_dim, rot_dim, 10000.0, {"rope_type": "linear", "factor": 2.0}, 16, style=style)
    pos = POSITIONS.to(device)
    table = rot._table(pos.device, int(pos.max()) + 1)
    qkv = _qkv(head_dim, dtype, device)
    out, ref = qkv.clone(), qkv.clone()
    rotary.rotary_embedding(out[:, :4], pos, table, rot_dim, style)
    rotary.rotary_embedding_ref(ref[:, :4], pos, table, rot_dim, style)
    assert_close(out, ref, dtype)
    assert torch.equal(out[..., rot_dim:], qkv[..., rot_dim:]), "dims past rot_dim must stay untouched"


def test_layer_dispatches(device):
    rot = Rotary(32, 16, 10000.0, None, 64, style="gptj")
    pos = POSITIONS.to(device)
    cos, sin = rot.cos_sin(pos, torch.float32)
    qkv = _qkv(32, torch.float32, device)
    out, ref = qkv.clone(), qkv.clone()
    with dispatch.kernels_mode("triton"):
        rot.rotate(out[:, :4], cos, sin)
    with dispatch.kernels_mode("torch"):
        rot.rotate(ref[:, :4], cos, sin)
    assert_close(out, ref, torch.float32)


def test_broken_variant_misses(device):
    """The interleaved kernel against the half-split reference."""
    rot = Rotary(32, 32, 10000.0, None, 64)
    pos = POSITIONS.to(device)
    cos, sin = rot.cos_sin(pos, torch.float32)
    qkv = _qkv(32, torch.float32, device)
    out, ref = qkv.clone(), qkv.clone()
    rotary.apply_rotary(out, cos, sin, 32, "gptj")
    rotary.apply_rotary_ref(ref, cos, sin, 32, "neox")
    assert_far(out, ref, torch.float32)
