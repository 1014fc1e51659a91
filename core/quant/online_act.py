"""Dynamic input quantization of weight-only Linears: `quantization.activation_quant`.

"fastllm_uint8" is what FastLLM's CPU int8 / int4 matmuls do to their input (OnlineQuantization
with LowBitConfig, 8 bits): per token row, or per group of G inputs when
`activation_group_size` is set (FastLLM's grouped int4), with a min / max that always spans 0:

    lo = min(0, min_k x_k),  hi = max(0, max_k x_k),  s = (hi - lo) / 255
    z = clamp(round(-lo / s), 0, 255),  q = clamp(floor(x / s + z + 0.5), q_min, 255)
    x' = (q - z) s                      (the layer then multiplies x' by its weight)

q_min is 0 for int4 weights and 1 for int8 weights: FastLLM's int8 x int8 kernel (AVX2, DotU8U8)
turns code 0 into 1 before its signed dot product (`u + !u`, so that u - 128 fits int8 sign
tricks), and sums the codes after that. The last group of a row may be shorter (FastLLM's
(K - 1) / G + 1 groups). Computed and returned in float32, and the layer multiplies in float32
(its compute dtype), as FastLLM scales its integer dot.

With this, ftllm 1.9.0's int4 (per row, grouped) and int8 CPU matmuls compute what the engine
computes up to float32 rounding (tests/sources/test_flm_fastllm.py). Not up to the bit: a code whose
x / s + z + 0.5 lies within float32 rounding of an integer can land one step apart in the two
runtimes, and on a trained model such a step grows through the following layers (docs/fastllm.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bestiary.core.kernels.cpu.ops import a8_dequantize_ref

ACTIVATION_QUANT = ("fastllm_uint8", "int8")


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> x dequantized from its symmetric int8 reading (activation_quant "int8", W8A8 dynamic),
    float32: per token row and block of A8_BLOCK features, s = max |x| / 127, q = round(x * (127 / max |x|)),
    x' = q s. The compiled kernels (core.kernels.cpu linear_a8.c, linear_w4a8.c) multiply the same codes in int32."""
    shape = x.shape
    return a8_dequantize_ref(x.reshape(-1, shape[-1])).reshape(shape)


def fastllm_uint8(x: torch.Tensor, group: int | None, min_code: int = 0) -> torch.Tensor:
    """x [..., K] -> x dequantized from FastLLM's uint8 online quantization (module doc), float32;
    `min_code` 1 for an int8 weight (FastLLM's int8 kernel reads code 0 as 1), else 0."""
    shape = x.shape
    size = group or shape[-1]
    pad = -shape[-1] % size  # zeros: they move neither min(0, .) nor max(0, .)
    g = F.pad(x.float(), (0, pad)).reshape(*shape[:-1], -1, size)  # [..., ceil(K/G), G]
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / 255).clamp(min=1e-30)
    z = torch.round(-lo / s).clamp(0, 255)
    q = torch.floor(g / s + z + 0.5).clamp(min_code, 255)
    return ((q - z) * s).reshape(*shape[:-1], -1)[..., : shape[-1]]
