"""Sampling contracts that `make mutation` (tests/mutation_run.py sampling) found untested.

Each test names the mutants of core/runtime/sampling.py it kills; the references are
written out here from the docstrings' math, not taken from the code under test.
"""

from __future__ import annotations

import math

import torch

from bestiary.core.kernels.sampling_ref import filter_logits
from bestiary.core.runtime.sampling import SamplingConfig, TokenChooser, make_generator, pad_outputs, sample


def test_filter_logits_boundaries() -> None:
    """top_k = 1 keeps the maximum only (filter_logits 3: `top_k > 1`); top_p = 1.0 is off even
    for a token of mass ~1e-44 (23, 24: the sort path at top_p 1.0 drops it, its mass before
    rounds to 1.0); a token whose mass before it equals top_p is dropped (47: `>` keeps it)."""
    x = torch.tensor([0.5, 2.0, -1.0, 1.0])
    assert filter_logits(x, 1, 1.0).tolist() == [-math.inf, 2.0, -math.inf, -math.inf]
    tiny = torch.tensor([0.0, -100.0])  # softmax: [1, 3.7e-44]
    assert torch.equal(filter_logits(tiny, 0, 1.0), tiny)
    halves = torch.tensor([0.0, 0.0, -200.0])  # probs exactly [0.5, 0.5, ~0]: the 2nd has 0.5 before it
    kept = torch.isfinite(filter_logits(halves, 0, 0.5))
    assert kept.sum() == 1 and not kept[2]


def test_sample_rows_greedy_and_tempered() -> None:
    """sample() over a batch: each greedy row its own argmax (sample 5: argmax over the batch
    dimension; 16: `break` after the first greedy row), and a sampled row drawn from
    softmax(filter(x / T)) (24: x * T) with the same generator state as the reference."""
    # column-wise argmaxes [2, 0, 0, 1] differ from the row-wise ones [1, 3, 2]
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5], [0.0, 0.0, 0.0, 2.0], [0.3, 0.1, 0.9, 0.8]])
    greedy = SamplingConfig(temperature=0.0)
    tempered = SamplingConfig(temperature=0.25)
    gens = [make_generator(0), make_generator(0), make_generator(7)]
    out = sample(logits, [greedy, greedy, tempered], gens)
    assert out[:2] == [1, 3]
    ref_gen = make_generator(7)
    expected = int(torch.multinomial(torch.softmax(logits[2] / 0.25, dim=-1), 1, generator=ref_gen))
    assert out[2] == expected
    # T = 0.25 against T = 4 is a different distribution: over 200 draws the sharper one picks
    # token 2 (p 0.55 at T 0.25 vs 0.27 at T 4) far more often
    sharp = sum(sample(logits[2:], [tempered], [g])[0] == 2 for g in [make_generator(s) for s in range(200)])
    assert sharp > 85


def test_token_chooser_log_probs_and_top_log_probs() -> None:
    """TokenChooser with output_log_probs and top_log_probs = 2 at T = 0.5: per step the token's
    log_softmax(x / T) and the two largest (token, log p) pairs (choose 21: x * T; 43-53: the
    top_log_probs entry; __init__ 10: the list starts as None)."""
    cfg = SamplingConfig(temperature=0.5, output_log_probs=True, top_log_probs=2, random_seed=3)
    chooser = TokenChooser(cfg, make_generator(3), None, [1, 2])
    rows = [torch.tensor([0.0, 1.0, 3.0, 2.0]), torch.tensor([1.0, 0.2, 0.1, 1.5])]
    ref_gen = make_generator(3)
    for row in rows:
        token = chooser.choose(row)
        log_p = torch.log_softmax(row / 0.5, dim=-1)
        assert token == int(torch.multinomial(log_p.exp(), 1, generator=ref_gen))
        assert math.isclose(chooser.log_probs[-1], float(log_p[token]), rel_tol=1e-6)
        best = sorted(range(4), key=lambda t: -float(log_p[t]))[:2]
        got = chooser.top_log_probs[-1]
        assert [t for t, _ in got] == best
        assert all(math.isclose(v, float(log_p[t]), rel_tol=1e-6) for t, v in got)
    assert len(chooser.top_log_probs) == 2


def test_pad_outputs_of_nothing() -> None:
    """No requests: shape [0, 0, 0]; requests without beams: [n, 0, 0] (pad_outputs 3, 5, 6, 9,
    11, 12: the max() defaults None / missing / 1)."""
    assert pad_outputs([], 0).shape == (0, 0, 0)
    assert pad_outputs([[], []], 0).shape == (2, 0, 0)
    assert pad_outputs([[[]]], 0).shape == (1, 1, 0)
