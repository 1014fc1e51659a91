"""core/layers rotary, 2D rotary and attention-window contracts that `make mutation`
(tests/mutation_run.py layers_numerics) found untested.

Each test names the mutants it kills. References are written out here: RoPE's
theta_i = base^(-2i/r) in float64, HF's linear / llama3 scaling as a formula (and, where it
helps, transformers' own ROPE_INIT_FUNCTIONS as an outside check), window masks as strings.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from bestiary.core.format.errors import ConfigError
from bestiary.core.kernels.attention_window import check_sinks, effective_window, visible_keys, window_visible
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.layers import rotary as rotary_module
from bestiary.core.layers.rotary import Rotary, rope_inv_freq
from bestiary.core.layers.rotary_2d import Rotary2D


def whole(message: str) -> str:
    """A pytest `match` pattern for exactly `message`."""
    return f"^{re.escape(message)}$"


def theta(rot_dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/rot_dim), i < rot_dim/2, in float64."""
    return torch.tensor([base ** (-2 * i / rot_dim) for i in range(rot_dim // 2)], dtype=torch.float64)


def cos_sin_reference(positions: list[int], rot_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(p theta_i), sin(p theta_i) [T, 1, rot_dim/2] in float64."""
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * theta(rot_dim, base)[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def hf_inv_freq(rot_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """transformers' own inverse frequencies for `scaling` (an outside reference)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=2 * rot_dim, num_attention_heads=2, head_dim=rot_dim,
                                      max_position_embeddings=256, rope_parameters=dict(scaling, rope_theta=base))
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")[0]


# --- rope_inv_freq -----------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [None, {}, {"rope_type": "default"}, {"type": "default"}])
def test_default_rope_is_base_to_the_minus_2i_over_r(scaling) -> None:
    """No scaling, an empty one or the kind "default" (either spelling): theta_i = base^(-2i/r),
    rot_dim/2 of them, float32 (rotary rope_inv_freq 11: arange(0, 2); 28, 29: the "default"
    spelling)."""
    got = rope_inv_freq(12, 500.0, scaling)
    assert got.dtype == torch.float32 and got.shape == (6,)
    torch.testing.assert_close(got.double(), theta(12, 500.0), rtol=1e-6, atol=0)


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_linear_rope_divides_every_frequency_by_the_factor(key) -> None:
    """Linear scaling ({"rope_type": "linear"} or transformers 4's older {"type": "linear"}):
    theta_i / factor, as transformers computes it (rope_inv_freq 19, 21, 24-26: the "type"
    spelling read as no scaling)."""
    got = rope_inv_freq(16, 10000.0, {key: "linear", "factor": 4.0})
    torch.testing.assert_close(got.double(), theta(16, 10000.0) / 4.0, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, hf_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 4.0}))


def llama3_reference(rot_dim: int, base: float, factor: float, low: float, high: float, old_len: float):
    """Llama 3.1's scaling per frequency, in float64: wavelength 2 pi / theta_i; shorter than
    old_len / high: kept; longer than old_len / low: divided by factor; between: interpolated
    with s = (old_len / wavelength - low) / (high - low) as (1 - s) theta / factor + s theta."""
    out = []
    for t in theta(rot_dim, base).tolist():
        wavelength = 2 * math.pi / t
        if wavelength < old_len / high:
            out.append(t)
        elif wavelength > old_len / low:
            out.append(t / factor)
        else:
            s = (old_len / wavelength - low) / (high - low)
            out.append((1 - s) * t / factor + s * t)
    return torch.tensor(out, dtype=torch.float64)


def test_llama3_rope_keeps_short_divides_long_and_smooths_between() -> None:
    """llama3 scaling with low_freq_factor 2 (not 1, where old_len / low == old_len * low): the
    three bands against the written-out formula and transformers (_llama3_inv_freq 16: low
    wavelength old_len * low)."""
    params = dict(factor=8.0, low_freq_factor=2.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    got = rope_inv_freq(64, 10000.0, {"rope_type": "llama3", **params})
    ref = llama3_reference(64, 10000.0, 8.0, 2.0, 4.0, 64.0)
    wavelength = 2 * math.pi / theta(64, 10000.0)
    assert (wavelength < 16).any() and ((wavelength > 16) & (wavelength < 32)).any() and (wavelength > 32).any()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(got, hf_inv_freq(64, 10000.0, {"rope_type": "llama3", **params}))


def test_llama3_band_edge_at_the_low_frequency_wavelength_is_divided_by_the_factor() -> None:
    """A wavelength exactly old_len / low_freq_factor is the smooth band's low end (s = 0):
    theta / factor, continuous with the longer wavelengths, as transformers gives it. theta_0 = 1
    has wavelength 2 pi (as float32 holds it); low_freq_factor is chosen to put the edge there
    (_llama3_inv_freq 29: `>=` divides by factor twice; 46: `<` leaves theta_0 unscaled)."""
    wavelength = (2 * math.pi / torch.tensor([1.0])).item()  # float32's 2 pi
    params = dict(factor=4.0, low_freq_factor=8 / wavelength, high_freq_factor=32 / wavelength,
                  original_max_position_embeddings=8)
    got = rope_inv_freq(2, 10000.0, {"rope_type": "llama3", **params})
    assert got.tolist() == [0.25]
    torch.testing.assert_close(got, hf_inv_freq(2, 10000.0, {"rope_type": "llama3", **params}))


@pytest.mark.parametrize("kind", ["dynamic", "ntk"])
def test_unsupported_rope_kinds_are_refused_by_name(kind) -> None:
    """A scaling kind other than default / linear / llama3 / yarn is refused with one message naming it
    (rope_inv_freq 44: the message dropped)."""
    message = f"rotary_scaling: unsupported rope_type {kind!r}; expected linear, llama3 or yarn"
    with pytest.raises(ConfigError, match=whole(message)):
        rope_inv_freq(8, 10000.0, {"rope_type": kind, "factor": 2.0})


# --- Rotary ------------------------------------------------------------------------------------


def test_rotary_style_defaults_to_neox_and_others_are_refused() -> None:
    """Rotary without a style is neox; a style other than neox / gptj is refused naming it
    (Rotary.__init__ 1, 2: the default; 8: the message)."""
    assert Rotary(8, 8, 10000.0, None, 4).style == "neox"
    assert Rotary(8, 8, 10000.0, None, 4, style="gptj").style == "gptj"
    with pytest.raises(ConfigError, match=whole("rotary style 'NEOX': expected neox or gptj")):
        Rotary(8, 8, 10000.0, None, 4, style="NEOX")


@pytest.mark.parametrize("head_dim,rot_dim", [(8, 8), (8, 4)])
def test_cos_sin_are_the_angles_at_the_positions(head_dim, rot_dim) -> None:
    """cos_sin(positions [T]) -> cos, sin [T, 1, rot_dim/2] = cos / sin(p theta_i), in the asked
    dtype, for unordered positions (Rotary._table 34, 36: cat on the wrong dim; cos_sin 20:
    unsqueeze(2); 14: the dtype dropped)."""
    rot = Rotary(head_dim, rot_dim, 100.0, None, 16)
    positions = [5, 0, 3, 15]
    ref_cos, ref_sin = cos_sin_reference(positions, rot_dim, 100.0)
    cos, sin = rot.cos_sin(torch.tensor(positions), torch.float32)
    assert cos.shape == sin.shape == (4, 1, rot_dim // 2) and cos.dtype == sin.dtype == torch.float32
    torch.testing.assert_close(cos.double(), ref_cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin.double(), ref_sin, rtol=0, atol=1e-5)
    cos, sin = rot.cos_sin(torch.tensor(positions), torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (4, 1, rot_dim // 2)
    torch.testing.assert_close(sin.double(), ref_sin, rtol=0, atol=1e-2)


def test_cos_sin_table_is_built_once_and_grown_past_max_positions(monkeypatch) -> None:
    """The cos/sin table is built on first use for max_positions rows and reused while it covers
    the positions asked (position max_positions - 1 included); a position past it grows it once;
    no positions give empty [0, 1, rot/2] (Rotary._table 1, 5, 37, cos_sin 2: rebuilt every call;
    _table 7, cos_sin 10: rebuilt for max_positions - 1; _table 2, 6, cos_sin 6, 8: not grown;
    cos_sin 7: max() of no positions)."""
    builds = []

    def counted(*args):
        builds.append(args)
        return rope_inv_freq(*args)

    monkeypatch.setattr(rotary_module, "rope_inv_freq", counted)
    rot = Rotary(8, 8, 100.0, None, 4)
    rot.cos_sin(torch.tensor([0]), torch.float32)
    rot.cos_sin(torch.arange(4), torch.float32)
    rot.cos_sin(torch.arange(4), torch.float32)
    assert len(builds) == 1
    cos, sin = rot.cos_sin(torch.tensor([9, 2]), torch.float32)
    rot.cos_sin(torch.tensor([2, 9]), torch.float32)
    assert len(builds) == 2
    ref_cos, ref_sin = cos_sin_reference([9, 2], 8, 100.0)
    torch.testing.assert_close(cos.double(), ref_cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin.double(), ref_sin, rtol=0, atol=1e-5)
    cos, sin = Rotary(8, 8, 100.0, None, 4).cos_sin(torch.tensor([], dtype=torch.int64), torch.float32)
    assert cos.shape == sin.shape == (0, 1, 4)


def test_cos_sin_table_lives_on_the_asked_device() -> None:
    """The table is built on the device of the positions (here `meta`, the one other device a
    CPU machine has) and kept there (Rotary._table 30: `.to(None)` leaves it on the CPU)."""
    rot = Rotary(8, 8, 100.0, None, 4)
    table = rot._table(torch.device("meta"), 4)
    assert table.device.type == "meta" and table.shape == (4, 8)
    assert rot._table(torch.device("meta"), 4) is table


def step_meta(positions: list[int]) -> AttentionMetadata:
    """One prefill step of one sequence with the given positions."""
    return AttentionMetadata.build([len(positions)], [0], [[0, 1]], 4, positions=torch.tensor(positions))


def test_step_cos_sin_is_shared_only_by_rotaries_with_the_same_tables() -> None:
    """step_cos_sin computes cos/sin once per step for every rotary of the same (rot_dim, base,
    scaling, dtype): an equal rotary gets the same tensors, one with another base or scaling or
    another dtype its own (Rotary.step_cos_sin 1, 5: one key for all; 4: the scaling left out of
    the key; 11: the dtype dropped)."""
    meta = step_meta([4, 1, 6])
    plain = Rotary(8, 8, 10000.0, None, 16)
    first = plain.step_cos_sin(meta, torch.float32)
    assert Rotary(8, 8, 10000.0, None, 16).step_cos_sin(meta, torch.float32) is first
    for base, scaling, divide in ((100.0, None, 1.0), (10000.0, {"rope_type": "linear", "factor": 2.0}, 2.0)):
        cos, sin = Rotary(8, 8, base, scaling, 16).step_cos_sin(meta, torch.float32)
        angles = torch.tensor([4.0, 1.0, 6.0], dtype=torch.float64)[:, None, None] * theta(8, base) / divide
        torch.testing.assert_close(cos.double(), angles.cos(), rtol=0, atol=1e-5)
        torch.testing.assert_close(sin.double(), angles.sin(), rtol=0, atol=1e-5)
    cos, sin = plain.step_cos_sin(meta, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    assert plain.step_cos_sin(meta, torch.float32) is first


# --- Rotary2D ----------------------------------------------------------------------------------


def test_rotary_2d_needs_a_head_size_divisible_by_4() -> None:
    """Rotary2D refuses a head size that does not split into two even halves (Rotary2D.__init__ 3:
    the message dropped)."""
    with pytest.raises(ConfigError, match=whole("2D rotary needs a head size divisible by 4, got 6")):
        Rotary2D(6, 10000.0, 16)


def test_rotary_2d_cos_sin_are_position_then_block_position_angles() -> None:
    """cos_sin(positions [2, T]) -> [2, T, 1, D/4]: index 0 the angles of the positions, index 1 of
    the block positions, theta_i = base^(-2i/(D/2)), in the asked dtype (Rotary2D.cos_sin 11, 17:
    the dtype dropped)."""
    rot = Rotary2D(8, 100.0, 8)
    positions = [[0, 1, 2, 2, 2], [0, 0, 0, 1, 2]]
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        cos, sin = rot.cos_sin(torch.tensor(positions), dtype)
        assert cos.shape == sin.shape == (2, 5, 1, 2) and cos.dtype == sin.dtype == dtype
        for row in range(2):
            ref_cos, ref_sin = cos_sin_reference(positions[row], 4, 100.0)
            torch.testing.assert_close(cos[row].double(), ref_cos, rtol=0, atol=atol)
            torch.testing.assert_close(sin[row].double(), ref_sin, rtol=0, atol=atol)


@pytest.mark.parametrize("shape", [(3, 4), (2,), (2, 2, 2)])
def test_rotary_2d_refuses_positions_not_shaped_2_by_t(shape) -> None:
    """Positions must be [2, T]; any other shape is refused with one message naming it
    (Rotary2D.cos_sin 1: `and` lets [3, T] and [2] through; 7, 8: the message)."""
    message = f"2D rotary expects positions of shape [2, T], got {shape}"
    with pytest.raises(ValueError, match=whole(message)):
        Rotary2D(8, 100.0, 8).cos_sin(torch.zeros(shape, dtype=torch.int64), torch.float32)


def test_rotary_2d_step_cos_sin_is_per_base_and_dtype() -> None:
    """Rotary2D.step_cos_sin shares one value per (head size, base, dtype) in a step: another base
    or dtype gets its own (Rotary2D.step_cos_sin 1, 4: one key for all; 10: the dtype dropped)."""
    meta = step_meta([0, 1, 2])
    meta.positions = torch.tensor([[0, 1, 2], [0, 0, 1]])
    first = Rotary2D(8, 10000.0, 8).step_cos_sin(meta, torch.float32)
    assert Rotary2D(8, 10000.0, 8).step_cos_sin(meta, torch.float32) is first
    cos, _ = Rotary2D(8, 100.0, 8).step_cos_sin(meta, torch.float32)
    for row, pos in enumerate(([0, 1, 2], [0, 0, 1])):
        torch.testing.assert_close(cos[row].double(), cos_sin_reference(pos, 4, 100.0)[0], rtol=0, atol=1e-5)
    cos, sin = Rotary2D(8, 10000.0, 8).step_cos_sin(meta, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16


# --- attention windows -------------------------------------------------------------------------


@pytest.mark.parametrize("layer,request_window,expected", [
    (0, 0, 0), (0, 5, 5), (7, 0, 7), (8, 4, 4), (4, 8, 4), (6, 6, 6),
])
def test_effective_window_is_the_smaller_with_0_as_infinity(layer, request_window, expected) -> None:
    """effective_window(layer, request) = min of the two, FULL (0) standing for no window
    (effective_window 3: the layer's always; 5-8: min of None / of one int)."""
    assert effective_window(layer, request_window) == expected


def visible_by_counting(q_first: int, q_last: int, window: int, sinks: int) -> list[int]:
    """Every key some query q_first..q_last sees: j <= q and (no window, j < S or q - j < W - S)."""
    return sorted({j for q in range(q_first, q_last + 1) for j in range(q + 1)
                   if window == 0 or j < sinks or q - j < window - sinks})


@pytest.mark.parametrize("q_first,q_last,window,sinks", [
    (3, 5, 4, 1),  # the rolling part starts at key 1, just past the one sink
    (4, 4, 4, 2), (2, 6, 4, 2), (0, 3, 4, 1), (9, 9, 5, 0), (7, 9, 10, 8), (5, 8, 0, 0),
])
def test_visible_keys_are_the_sinks_then_the_rolling_part(q_first, q_last, window, sinks) -> None:
    """visible_keys lists, ascending and once each, every key a query of the span sees
    (visible_keys 21: the sink dropped when the rolling part starts at key 1)."""
    assert visible_keys(q_first, q_last, window, sinks).tolist() == visible_by_counting(q_first, q_last, window,
                                                                                        sinks)


def mask(*rows: str) -> torch.Tensor:
    """A [n, K] bool mask from rows of '1' (visible) and '.' (hidden)."""
    return torch.tensor([[c == "1" for c in row] for row in rows])


@pytest.mark.parametrize("window,sinks,prefix,expected", [
    (0, 0, 0, mask("1.....", "11....", "111...", "1111..", "11111.", "111111")),  # window 0: causal
    (3, 0, 0, mask("1.....", "11....", "111...", ".111..", "..111.", "...111")),
    (4, 1, 0, mask("1.....", "11....", "111...", "1111..", "1.111.", "1..111")),
    (0, 0, 3, mask("111...", "111...", "111...", "1111..", "11111.", "111111")),  # prefix-LM: keys < 3
    (3, 0, 2, mask("11....", "11....", "111...", ".111..", "..111.", "...111")),
])
def test_window_visible_masks(window, sinks, prefix, expected) -> None:
    """window_visible for queries and keys 0..5: causal, a prefix-LM's first `prefix` keys seen by
    every query, then the window of W keys counting S sinks (window_visible 6: key `prefix` itself
    seen by the prefix)."""
    pos = torch.arange(6)
    assert torch.equal(window_visible(pos, pos, window, sinks, prefix), expected)


def test_check_sinks_messages() -> None:
    """check_sinks refuses negative sinks, sinks without a window and sinks >= the window, each with
    its whole message (check_sinks 3: the first message dropped; 7, 8: the hint's text)."""
    with pytest.raises(ValueError, match=whole("sink_token_length -1: expected >= 0")):
        check_sinks(8, -1, "the request")
    with pytest.raises(ValueError, match=whole(
            "sink_token_length 2 needs an attention window (the request has none): set max_attention_window")):
        check_sinks(0, 2, "the request")
    with pytest.raises(ValueError, match=whole(
            "sink_token_length 4 must be smaller than the attention window 4 (layer 0)")):
        check_sinks(4, 4, "layer 0")
    check_sinks(4, 3, "layer 0")
    check_sinks(0, 0, "the request")
