"""YaRN rope scaling (core.layers.yarn) against transformers' own `_compute_yarn_parameters`: the
frequencies and the cos / sin attention factor, over the fields that change them."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bestiary.core.layers.rotary import Rotary, rope_attention_factor, rope_inv_freq  # noqa: E402
from bestiary.core.layers.yarn import yarn_mscale  # noqa: E402

MAX_POSITIONS = 4096
SCALINGS = {
    "plain": {"factor": 4.0, "original_max_position_embeddings": 1024},
    "no_truncate_betas": {"factor": 32.0, "original_max_position_embeddings": 256, "beta_fast": 16, "beta_slow": 2,
                          "truncate": False},  # gpt-oss's fields, smaller
    "mscales": {"factor": 40.0, "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 0.707},
    "mscale_ratio": {"factor": 16.0, "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 0.5},
    "attention_factor": {"factor": 8.0, "original_max_position_embeddings": 512, "attention_factor": 0.8},
    "factor_from_lengths": {"factor": None, "original_max_position_embeddings": 1024},
}


def hf_yarn(scaling: dict, rot_dim: int, base: float) -> tuple[torch.Tensor, float]:
    """transformers' inv_freq and attention factor for a LLaMA config carrying `scaling`."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    config = transformers.LlamaConfig(hidden_size=rot_dim * 2, num_attention_heads=2, head_dim=rot_dim,
                                      max_position_embeddings=MAX_POSITIONS)
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": base, **scaling}
    return _compute_yarn_parameters(config, "cpu")


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_yarn_matches_transformers(name) -> None:
    """theta' and the attention factor equal transformers' for each field set, and differ from plain RoPE."""
    scaling = {"rope_type": "yarn", **SCALINGS[name]}
    hf_freq, hf_factor = hf_yarn(SCALINGS[name], 64, 10000.0)
    ours = rope_inv_freq(64, 10000.0, scaling, MAX_POSITIONS)
    torch.testing.assert_close(ours, hf_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling, MAX_POSITIONS) == pytest.approx(hf_factor, rel=1e-12)
    plain = rope_inv_freq(64, 10000.0, None)
    assert not torch.allclose(ours, plain), "yarn left every frequency as it was"
    assert ours[0] == plain[0] and ours[-1] == pytest.approx(plain[-1].item() / (scaling["factor"] or 4.0))


def test_yarn_scales_the_cos_sin_table() -> None:
    """Rotary's cos / sin rows carry the attention factor a: cos^2 + sin^2 = a^2 at every position."""
    scaling = {"rope_type": "yarn", **SCALINGS["mscale_ratio"]}
    rotary = Rotary(16, 16, 10000.0, scaling, MAX_POSITIONS)
    cos, sin = rotary.cos_sin(torch.arange(0, 4000, 37), torch.float32)
    expected = yarn_mscale(16.0, 1.0) / yarn_mscale(16.0, 0.5)
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, expected**2))
    assert expected == pytest.approx((0.1 * math.log(16) + 1) / (0.05 * math.log(16) + 1))


def test_yarn_refuses_a_base_of_one() -> None:
    """rope_theta 1 (a positive number, so it passes the field check) would divide by ln(1): one-line ConfigError."""
    from bestiary.core.format.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^rotary_scaling: yarn needs rope_theta > 1 \(got 1\)$"):
        rope_inv_freq(8, 1.0, {"rope_type": "yarn", "factor": 2.0})
