"""AWQ's per-input-channel scale search (Lin et al., 2023), with the error measured through H.

Scaling input channel k of the weight up by s_k and the activation down by the same factor
leaves y = x W^T unchanged, (x / s) (W diag(s))^T, but changes how W rounds: salient channels
(large activations) get a finer effective step. AWQ searches one exponent per layer:

    s(alpha) = absmax^alpha / sqrt(max(absmax^alpha) * min(absmax^alpha))   (normalised around 1)
    alpha*   = argmin over alpha in {0, 1/G, ..., (G-1)/G} of
               trace(dW H dW^T),   dW = quantize(W diag(s)) diag(s)^-1 - W

where H = sum_t x_t x_t^T (core.quant.input_stats), so the output error over the calibration
tokens is exact without keeping them. alpha = 0 is s = 1 (plain quantization), so the search
never does worse than no scaling on the calibration data. The caller stores W diag(s)
quantized and multiplies the activations by 1/s (pre_quant_scale / prequant_scaling_factor).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bestiary.core.quant.gptq import hessian_error
from bestiary.core.quant.input_stats import LinearInputStats

GRID = 20
REFINE = 0.01  # float32 errors within 1% of the best go to the float64 comparison


def awq_scale(absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] = absmax^alpha normalised so that max(s) * min(s) = 1 (dead channels count as 1e-4)."""
    s = absmax.float().clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def search_awq_scale(
    w: torch.Tensor,
    stats: LinearInputStats,
    quantize: Callable[[torch.Tensor], torch.Tensor],
    grid: int = GRID,
) -> torch.Tensor:
    """w [N, K], input stats (with hessian) -> s float32 [K] minimising the output error (docstring).

    `quantize`: W [N, K] float -> its quantized-then-dequantized float32 [N, K]."""
    if stats.hessian is None:
        raise ValueError("search_awq_scale needs the input Hessian (collect_linear_inputs(..., hessian=True))")
    return search_shared_scale([w], stats.hessian, stats.absmax, quantize, grid)


def search_shared_scale(
    weights: list[torch.Tensor],
    hessian: torch.Tensor,
    salience: torch.Tensor,
    quantize: Callable[[torch.Tensor], torch.Tensor],
    grid: int = GRID,
) -> torch.Tensor:
    """One s [K] for weights [N_i, K] that read the same input (Hessian [K, K]): s = awq_scale(salience,
    alpha) with alpha minimising the summed output error sum_i trace(dW_i H dW_i^T) (alpha = 0: s = 1).

    The errors are compared in float64 (hessian_error), as the search always did, but only for the
    candidates a float32 pass finds within REFINE of its best: a float32 error is off by far less
    than that, so the float64 winner is among them and the choice is the all-float64 one, at a few
    float64 [N, K] x [K, K] products per layer instead of `grid`."""
    weights = [w.float() for w in weights]
    h32, h64 = hessian.float(), hessian.double()
    scales = [awq_scale(salience, i / grid) for i in range(grid)]  # [K] each

    def delta(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # dW [N, K] of candidate s
        return quantize(w * s[None, :]) / s[None, :] - w

    rough = [sum(_error32(delta(w, s), h32) for w in weights) for s in scales]
    best_rough = min(rough)
    best_s, best_err = torch.ones(weights[0].shape[1]), float("inf")
    for s, r in zip(scales, rough):
        if r > best_rough * (1 + REFINE):
            continue
        err = sum(hessian_error(delta(w, s), h64) for w in weights)
        if err < best_err:
            best_s, best_err = s, err
    return best_s


def _error32(dw: torch.Tensor, h: torch.Tensor) -> float:
    """hessian_error with the product in float32 (the candidates' first pass)."""
    return float(((dw @ h) * dw).sum(dtype=torch.float64))
