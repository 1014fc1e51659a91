"""Activation-quantized Linear slots: FP8, W8A8_SQ_PER_CHANNEL (SmoothQuant) and W4A8_AWQ.

Like core.quant.slot.WeightOnlySlot, `ActQuantSlot.install(linear, lq)` swaps the float
`weight` for the packed one and adds the checkpoint spec's scale tensors, so `load_state_dict`
and the converter treat both slot kinds alike. Per Linear (N out, K in features, this rank):

    FP8                  weight float8_e4m3fn [N, K]   weights_scaling_factor float32 [1]
                         activation_scaling_factor float32 [1]
    W8A8_SQ_PER_CHANNEL  weight int8 [N, K]            weights_scaling_factor [N]
                         prequant_scaling_factor [K]   activation_scaling_factor float32 [1]
    W4A8_AWQ             weight uint8 [N, K/2] (packing.pack_int4, symmetric, zero point 8)
                         weights_scaling_factor [N, ceil(K/G)]
                         prequant_scaling_factor [K]   activation_scaling_factor float32 [1]

(scales without a dtype above are in the checkpoint dtype). The layer computes

    x' = x * p                              p = prequant_scaling_factor (1 if absent)
    FP8 activations:  a = fp8(clamp(x' / s_a, -448, 448))
    int8 activations: a = clamp(round(x' / s_a), -127, 127)
    y = (a @ Wq^T) * s_a * s_w + b          Wq: the stored codes; s_w per tensor / per row;
                                            W4A8: (a @ ((q - 8) * s_group)^T) * s_a

with s_a a static per-tensor activation scale (calibrated amax / qmax). This is TensorRT-LLM's
reading of these names: QuantMode.from_quant_algo(W8A8_SQ_PER_CHANNEL) is
use_smooth_quant(per_token=False, per_channel=True), i.e. per-channel weights with a
per-tensor activation scale (the per-token variants are separate *_PLUGIN algos).
Unlike TensorRT-LLM's W4A8 kernel, no second per-tensor weight scale
(weights_scaling_factor_2) is stored: the group scales are full precision.

Quantizing at convert (`quantize(w, scale_dtype, stats)`, stats: the layer's input statistics,
core.quant.input_stats.LinearInputStats with absmax [K] = max_t |x[t, k]|):

    FP8:         s_w = max|W| / 448,  s_a = max_k absmax_k / 448
    SmoothQuant: per input channel j, s_j = absmax_j^alpha / max_n |W[n, j]|^(1 - alpha);
                 p = 1 / s_j;  W' = W diag(s) quantized int8 per output channel
                 (s_w[n] = max_j |W'[n, j]| / 127);  s_a = max_j (absmax_j p_j) / 127
    W4A8_AWQ:    s from the AWQ grid search (core.quant.awq.search_awq_scale) over the layer's
                 inputs (the weight error through the input Hessian; the FP8 rounding of
                 the activations is not part of it), else s = absmax^0.5 normalised; p = 1 / s;  W' = W diag(s)
                 int4 group-wise symmetric;  s_a = max_j (absmax_j p_j) / 448

Since x' W'^T = x diag(p) diag(s) W^T = x W^T, smoothing changes nothing but where the range
sits. p is rounded to its stored dtype first and W' built from the stored p, so the identity
holds for the tensors in the file.

Running: the codes are multiplied exactly (int8 x int8 into int32: torch._int_mm on CUDA, a float GEMM on
the CPU (_int8_matmul), FP8
codes in float32, which holds every product), then scaled: the same numbers a real W8A8/FP8
GEMM with float32 accumulation computes. W4A8 dequantizes the int4 weight to float32 and
multiplies it with the dequantized FP8 activations (a reference, not a fast kernel).
Outputs are cast back to x's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from bestiary.core.format import packing
from bestiary.core.layers.linear import Linear
from bestiary.core.quant.awq import awq_scale, search_awq_scale
from bestiary.core.quant.input_stats import LinearInputStats
from bestiary.core.quant.modes import LinearQuant, check_linear
from bestiary.core.quant.slot import install_int_weight

FP8_ALGO = "FP8"
SQ_ALGO = "W8A8_SQ_PER_CHANNEL"
W4A8_ALGO = "W4A8_AWQ"
ACT_ALGOS = (FP8_ALGO, SQ_ALGO, W4A8_ALGO)
PREQUANT = "prequant_scaling_factor"
ACT_SCALE = "activation_scaling_factor"
SCALE_NAMES = ("weights_scaling_factor", PREQUANT, ACT_SCALE)
DEFAULT_ALPHA = 0.5  # SmoothQuant migration strength (the paper's and TensorRT-LLM's default)
MIN_SMOOTHING = 1e-5  # smoothing factors are clamped to at least this (dead input channels)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 codes of x / scale (clamped to +-448), as float32: x ~ codes * scale."""
    return (x.float() / scale.float()).clamp(-packing.FP8_MAX, packing.FP8_MAX).to(torch.float8_e4m3fn).float()


def quant_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes clamp(round(x / scale), -127, 127): x ~ codes * scale."""
    return torch.round(x.float() / scale.float()).clamp(-packing.INT8_MAX, packing.INT8_MAX).to(torch.int8)


def smoothing_factors(absmax: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s [K]: s_j = absmax_j^alpha / max_n |w[n, j]|^(1 - alpha), at least MIN_SMOOTHING."""
    wmax = w.float().abs().amax(dim=0).clamp(min=1e-8)  # [K]
    s = absmax.float().clamp(min=1e-8).pow(alpha) / wmax.pow(1 - alpha)
    return s.clamp(min=MIN_SMOOTHING)


class ActQuantSlot:
    """FP8 / SmoothQuant int8 / W4A8 weights of one Linear with a static activation scale."""

    def __init__(self, lq: LinearQuant, shape: tuple[int, int], in_offset: int = 0) -> None:
        if lq.algo not in ACT_ALGOS:
            raise ValueError(f"ActQuantSlot: {lq.algo} is not an activation-quantized algorithm")
        self.lq = lq
        self.out_local, self.in_local = shape
        self.in_offset = in_offset  # first in-feature of this rank (row-parallel on tp ranks)
        self.alpha = DEFAULT_ALPHA  # SmoothQuant migration strength, used at quantize time only
        self.compute_dtype = torch.float32  # accumulation is always float32 / int32 (see module doc)
        self.max_kernel_tokens: int | None = 0  # unused: one path for every step

    @property
    def has_prequant(self) -> bool:
        return self.lq.algo != FP8_ALGO

    @property
    def int8_activations(self) -> bool:
        return self.lq.algo == SQ_ALGO

    # --- building the layer ------------------------------------------------------------------
    @classmethod
    def install(cls, linear: Linear, lq: LinearQuant) -> ActQuantSlot:
        """Replace linear.weight by the packed weight and add the algorithm's scale parameters."""
        n, k = linear.weight.shape
        split_in = linear.parallel == "row" and linear.tp_size > 1
        check_linear(linear.name, k, n, lq, split_in=split_in)
        dtype, device = linear.weight.dtype, linear.weight.device
        f32 = torch.float32
        if lq.algo == FP8_ALGO:
            linear.weight = _param(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device))
            linear.weights_scaling_factor = _param(torch.empty(1, dtype=f32, device=device))
        else:  # SmoothQuant: int8 per output channel; W4A8_AWQ: int4 group-wise
            install_int_weight(linear, 8 if lq.algo == SQ_ALGO else 4, lq.group_size)
        if lq.algo != FP8_ALGO:
            linear.prequant_scaling_factor = _param(torch.empty(k, dtype=dtype, device=device))
        linear.activation_scaling_factor = _param(torch.empty(1, dtype=f32, device=device))
        slot = cls(lq, (n, k), linear.tp_rank * k if split_in else 0)
        linear.quant = slot
        return slot

    def tp_dim(self, name: str, weight_dim: int, is_column: bool) -> int:
        """Slicing dim of tensor `name`: per-row scales follow a column-parallel layer's out dim,
        the prequant scale (and W4A8's group dim) a row-parallel layer's in dim; per-tensor
        scales are replicated."""
        if name == "weight" or weight_dim < 0:
            return weight_dim
        if name == ACT_SCALE or (name == "weights_scaling_factor" and self.lq.algo == FP8_ALGO):
            return -1
        if name == PREQUANT:
            return -1 if is_column else 0
        if is_column:
            return 0
        return 1 if self.lq.bits == 4 else -1

    def local_stats(self, stats: LinearInputStats | None) -> LinearInputStats:
        """This rank's slice of the input statistics (they may cover every rank's in-features)."""
        if stats is None:
            raise ValueError(f"{self.lq.algo} needs the layer's input statistics (activation calibration)")
        k = stats.absmax.numel()
        if k == self.in_local:
            return stats
        lo, hi = self.in_offset, self.in_offset + self.in_local
        if k < hi:
            raise ValueError(f"input statistics cover {k} features, the layer has {self.in_local}")
        h = None if stats.hessian is None else stats.hessian[lo:hi, lo:hi]
        return LinearInputStats(stats.absmax[lo:hi], stats.amax, h, stats.tokens)

    def quantize(self, w: torch.Tensor, scale_dtype: torch.dtype,
                 stats: LinearInputStats | None = None) -> dict[str, torch.Tensor]:
        """Float weight [N, K] + input statistics -> {parameter name: tensor} (see the module doc)."""
        if tuple(w.shape) != (self.out_local, self.in_local):
            raise ValueError(f"weight {tuple(w.shape)} does not match the layer's {(self.out_local, self.in_local)}")
        w = w.float()
        stats = self.local_stats(stats)
        absmax = stats.absmax.float()  # [K]
        f32 = torch.float32
        if self.lq.algo == FP8_ALGO:
            q, s = packing.quantize_fp8_per_tensor(w)
            amax = max(float(stats.amax), float(absmax.max()))  # the whole input, on every rank
            return {"weight": q, "weights_scaling_factor": s.reshape(1).to(f32),
                    ACT_SCALE: _act_scale(amax, packing.FP8_MAX)}
        s = self._smoothing(w, stats)  # [K]
        p = (1.0 / s).to(scale_dtype)  # stored prequant scale; W' is built from what is stored
        smoothed = w / p.float()[None, :]  # W diag(s): [N, K]
        amax = float((absmax * p.float()).max())
        if self.lq.algo == SQ_ALGO:
            q, sw = packing.quantize_int8_per_channel(smoothed)
            return {"weight": q, "weights_scaling_factor": sw.to(scale_dtype), PREQUANT: p,
                    ACT_SCALE: _act_scale(amax, packing.INT8_MAX)}
        codes, sg, _ = packing.quantize_int4_groupwise(smoothed, self.lq.group_size, False)
        return {"weight": packing.pack_int4(codes), "weights_scaling_factor": sg.to(scale_dtype), PREQUANT: p,
                ACT_SCALE: _act_scale(amax, packing.FP8_MAX)}

    def _smoothing(self, w: torch.Tensor, stats: LinearInputStats) -> torch.Tensor:
        """s [K] with x W^T = (x / s) (W diag(s))^T: SmoothQuant's, or AWQ's searched one
        (absmax^0.5 normalised when the statistics hold no Hessian to search with)."""
        if self.lq.algo == SQ_ALGO:
            return smoothing_factors(stats.absmax, w, self.alpha)
        if stats.hessian is None:
            return awq_scale(stats.absmax, 0.5)
        return search_awq_scale(w, stats, self._int4_roundtrip)

    def _int4_roundtrip(self, w: torch.Tensor) -> torch.Tensor:
        """W [N, K] -> its symmetric int4 group-wise quantized-dequantized float32 [N, K]."""
        return packing.int4_roundtrip(w, self.lq.group_size, False)

    # --- reading the weight back -------------------------------------------------------------
    def dequantize(self, linear: Linear) -> torch.Tensor:
        """The float32 weight [N, K] the stored tensors stand for, in the smoothed input space
        (y = (x * prequant_scaling_factor) W^T without activation rounding)."""
        s = linear.weights_scaling_factor
        if self.lq.algo == FP8_ALGO:
            return packing.dequantize_fp8(linear.weight, s)
        if self.lq.algo == SQ_ALGO:
            return packing.dequantize_int8(linear.weight, s)
        return packing.dequantize_int4(packing.unpack_int4(linear.weight), s, None, self.lq.group_size)

    def quantize_input(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> activation codes [T, K] (int8, or FP8 values as float32) of x * prequant / s_a."""
        xs = x.float()
        if self.has_prequant:
            xs = xs * linear.prequant_scaling_factor.float()
        s_a = linear.activation_scaling_factor
        return quant_int8(xs, s_a) if self.int8_activations else fake_quant_fp8(xs, s_a)

    # --- running -----------------------------------------------------------------------------
    def prepare(self, linear: Linear) -> None:
        """Nothing to repack: every device reads the checkpoint layout."""

    def set_compute_dtype(self, linear: Linear, dtype: torch.dtype) -> None:
        """Recorded only: these layers accumulate in float32 / int32 whatever is asked (exact codes)."""
        self.compute_dtype = dtype

    def fuse(self, members: list[Linear]) -> None:
        """Activation-quantized linears are not fused (each quantizes its own input)."""
        return None

    def matmul(self, linear: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> y [..., N] in x's dtype (see the module doc for the arithmetic)."""
        x2 = x.reshape(-1, x.shape[-1])  # [T, K]
        a = self.quantize_input(linear, x2)  # [T, K] codes
        s_a = linear.activation_scaling_factor.float()
        s_w = linear.weights_scaling_factor.float()
        if self.lq.algo == SQ_ALGO:
            y = _int8_matmul(a, linear.weight).float() * (s_a * s_w)  # [T, N]
        elif self.lq.algo == FP8_ALGO:
            y = (a @ linear.weight.float().t()) * (s_a * s_w)
        else:
            y = (a @ self.dequantize(linear).t()) * s_a
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])


def _act_scale(amax: float, qmax: float) -> torch.Tensor:
    """Static per-tensor activation scale float32 [1] = amax / qmax."""
    return torch.tensor([max(amax, 1e-8) / qmax], dtype=torch.float32)


# |a w| <= 128 * 128 = 2^14 per product, so a sum over K <= 2^10 features never leaves float32's exact
# integers (2^24), in any summation order.
FLOAT32_EXACT_K = 1 << 10


def _int8_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int8 a [T, K] x int8 w [N, K] -> int32 [T, N], exact. On the CPU a float GEMM: float32 where K <=
    FLOAT32_EXACT_K, else float64 (exact far past these sizes). torch._int_mm there ran 8x slower than the
    float64 GEMM on an AVX2 CPU (0.35 s against 0.046 for [512, 576] x [576, 1536], one thread), which made the
    W8A8 SmoothQuant perplexity gate a 10-minute CI step. Elsewhere torch._int_mm where it takes the shapes
    (CUDA wants T > 16), else float64."""
    if a.device.type == "cpu":
        dtype = torch.float32 if a.shape[1] <= FLOAT32_EXACT_K else torch.float64
        return (a.to(dtype) @ w.to(dtype).t()).to(torch.int32)
    try:
        return torch._int_mm(a, w.t())
    except RuntimeError:  # shape/device limits of _int_mm
        return (a.double() @ w.double().t()).to(torch.int32)


def set_smoothquant_alpha(slots: Iterable[object], alpha: float) -> None:
    """Give every SmoothQuant slot in `slots` the migration strength `alpha` (0 < alpha <= 1)."""
    from bestiary.core.format.errors import ConfigError

    if not 0 < alpha <= 1:
        raise ConfigError(f"--smoothquant {alpha}: expected a migration strength alpha with 0 < alpha <= 1")
    for slot in slots:
        if isinstance(slot, ActQuantSlot) and slot.lq.algo == SQ_ALGO:
            slot.alpha = alpha
