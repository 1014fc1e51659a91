"""Dynamic input quantization of weight-only Linears: `quantization.activation_quant`.

"fastllm_uint8" is what FastLLM's CPU int8 / int4 matmuls do to their input (OnlineQuantization
with LowBitConfig, 8 bits): per token row, or per group of G inputs when
`activation_group_size` is set (FastLLM's grouped int4), with a min / max that always spans 0:

    lo = min(0, min_k x_k),  hi = max(0, max_k x_k),  s = (hi - lo) / 255
    z = clamp(round(-lo / s), 0, 255),  q = clamp(floor(x / s + z + 0.5), 0, 255)
    x' = (q - z) s                      (the layer then multiplies x' by its weight)

The last group of a row may be shorter (FastLLM's (K - 1) / G + 1 groups). Computed and returned in float32,
and the layer multiplies in float32 (its compute dtype), as FastLLM scales its integer dot.

This is exactly what ftllm 1.9.0's int4 CPU matmuls (per row, and grouped int4) multiply
(tests/test_flm_fastllm.py). Its int8 matmul also quantizes its input, but its integer kernel
is not reproduced here: with this setting an int8 engine is closer to ftllm than without it,
not equal to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATION_QUANT = ("fastllm_uint8",)


def fastllm_uint8(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x [..., K] -> x dequantized from FastLLM's uint8 online quantization (module doc), float32."""
    shape = x.shape
    size = group or shape[-1]
    pad = -shape[-1] % size  # zeros: they move neither min(0, .) nor max(0, .)
    g = F.pad(x.float(), (0, pad)).reshape(*shape[:-1], -1, size)  # [..., ceil(K/G), G]
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / 255).clamp(min=1e-30)
    z = torch.round(-lo / s).clamp(0, 255)
    q = torch.floor(g / s + z + 0.5).clamp(0, 255)
    return ((q - z) * s).reshape(*shape[:-1], -1)[..., : shape[-1]]

