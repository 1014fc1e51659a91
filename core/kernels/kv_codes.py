"""INT8 / FP8 codes of a quantized KV cache pool, and their reading back.

With a layer's scale s (s_k for keys, s_v for values; core.quant.kv holds them):

    INT8:  q = clamp(round(x / s), -127, 127) as int8          x ~ q * s
    FP8:   q = float8_e4m3fn(clamp(x / s, -448, 448))           x ~ q * s
"""

from __future__ import annotations

import torch

KV_DTYPES = {"INT8": torch.int8, "FP8": torch.float8_e4m3fn}
QMAX = {"INT8": 127.0, "FP8": 448.0}


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..] float -> codes of `dtype` with x ~ codes * scale (scale: a 0-d or [1] tensor)."""
    y = x.float() / scale.float()
    if dtype == torch.int8:
        return torch.round(y).clamp_(-127, 127).to(torch.int8)
    return y.clamp_(-QMAX["FP8"], QMAX["FP8"]).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 tensors viewed as uint8 (the CPU has no index_copy_/index_select for float8)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes int8/fp8 -> codes * scale in `dtype`."""
    return (codes.float() * scale.float()).to(dtype)
