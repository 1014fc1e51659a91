"""INT8 / FP8 KV cache: quantized pools, per-layer scales, calibration at convert.

Checkpoint: `transformer.layers.{i}.attention.kv_cache_scaling_factor`, float32 [2] =
(s_k, s_v), one scale for the keys and one for the values of the layer (TensorRT-LLM keeps
a single [1] scale for both; keys after RoPE are often 10x wider than values, so one shared
int8 step would waste most of the values' range). A pool holds

    INT8:  q = clamp(round(x / s), -127, 127) as int8          x ~ q * s
    FP8:   q = float8_e4m3fn(clamp(x / s, -448, 448))           x ~ q * s

and s = amax / qmax over a calibration pass of the converted model (amax of |K| and |V|
per layer, qmax 127 or 448; core.convert.kv_scales); values beyond the calibrated range are clamped.

Attention itself is unchanged: `PagedAttention` quantizes the step's new K/V into the
pools (`write_kv(..., scales)`), then dequantizes the blocks this step reads into a float
scratch pool of one layer's size, shared by all layers, and attends over that (same block
indices, so the metadata and every attention kernel work as they are). KV memory: int8
and fp8 take 1 byte per value, half of bf16/fp16 and a quarter of fp32; the scratch adds
one float layer.
"""

from __future__ import annotations

import torch

from bestiary.core.kernels.kv_codes import KV_DTYPES, QMAX, as_bytes, dequantize_kv
from bestiary.core.kernels.metadata import AttentionMetadata

SCALE_NAME = "kv_cache_scaling_factor"


def kv_cache_dtype(config, default: torch.dtype) -> torch.dtype:
    """Pool dtype: int8 / float8_e4m3fn under kv_cache_quant_algo INT8 / FP8, else `default`."""
    algo = config.quantization.kv_cache_quant_algo
    return KV_DTYPES[algo] if algo else default


_scratch: dict[str, torch.Tensor] = {}


def scratch_pool(like: torch.Tensor, dtype: torch.dtype, which: str) -> torch.Tensor:
    """A float pool shaped like one layer's pool `like` [num_blocks, bs, KVH, D] for `which`
    ("k" or "v"), shared by every layer (a step runs its layers one after the other)."""
    pool = _scratch.get(which)
    if pool is None or pool.shape != like.shape or pool.dtype != dtype or pool.device != like.device:
        pool = _scratch[which] = torch.zeros(like.shape, dtype=dtype, device=like.device)
    return pool


def blocks_read(meta: AttentionMetadata) -> torch.Tensor:
    """Indices [n] of the pool blocks this step reads (every block of every block table)."""
    cached = meta.__dict__.get("_kv_quant_blocks")
    if cached is None or cached.device != meta.block_tables.device:
        cached = meta.block_tables.unique()
        meta.__dict__["_kv_quant_blocks"] = cached
    return cached


def _select(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """pool[blocks] in the pool's dtype (through bytes for float8)."""
    return as_bytes(pool).index_select(0, blocks).view(pool.dtype)


class KVQuant:
    """The KV quantization of one attention layer: its pools' dtype and the owner's scales."""

    def __init__(self, algo: str, owner: torch.nn.Module) -> None:
        self.algo = algo
        self.dtype = KV_DTYPES[algo]
        self.owner = owner  # the module holding kv_cache_scaling_factor [2]

    @property
    def scales(self) -> torch.Tensor:
        """(s_k, s_v) float32 [2]."""
        return getattr(self.owner, SCALE_NAME)

    def float_pools(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch float pools holding the dequantized blocks this step reads (others: stale)."""
        blocks = blocks_read(meta)
        s = self.scales
        k_out = scratch_pool(k_pool, dtype, "k")
        k_out.index_copy_(0, blocks, dequantize_kv(_select(k_pool, blocks), s[0], dtype))
        v_out = scratch_pool(v_pool, dtype, "v")
        v_out.index_copy_(0, blocks, dequantize_kv(_select(v_pool, blocks), s[1], dtype))
        return k_out, v_out


def install_kv_quant(model: torch.nn.Module, algo: str) -> None:
    """Give every attention layer (a module with a PagedAttention `attn`) a kv_cache_scaling_factor
    [2] parameter and a KVQuant its PagedAttention uses."""
    from bestiary.core.layers.attention import PagedAttention

    for module in model.modules():
        attn = getattr(module, "attn", None)
        if isinstance(attn, PagedAttention):
            device = next((p.device for p in module.parameters()), None)
            setattr(module, SCALE_NAME, torch.nn.Parameter(torch.ones(2, device=device), requires_grad=False))
            attn.kv_quant = KVQuant(algo, module)


def scales_from_amax(amax: tuple[float, float], algo: str) -> torch.Tensor:
    """(s_k, s_v) float32 [2] = amax / qmax (a zero range gets scale 1)."""
    return torch.tensor([a / QMAX[algo] if a > 0 else 1.0 for a in amax], dtype=torch.float32)
