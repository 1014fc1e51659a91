"""Turn a model's Linear layers into quantized ones, as its config's `quantization` says.

Called by DecoderLM at the end of its constructor (on the meta device, before loading), so
the model's state dict has the checkpoint's quantized names and shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bestiary.core.format.config import PretrainedConfig
from bestiary.core.layers.linear import Linear
from bestiary.core.quant.kv import install_kv_quant
from bestiary.core.quant.modes import ACT_ALGOS, LinearQuant, linear_quant_of, quantizes
from bestiary.core.quant.slot import WeightOnlySlot


def quantized_linears(model: nn.Module) -> dict[str, Linear]:
    """module path -> Linear for every Linear of `model` holding quantized weights."""
    return {path: m for path, m in model.named_modules() if isinstance(m, Linear) and m.quant is not None}


def install_quantization(model: nn.Module, config: PretrainedConfig) -> None:
    """Install a WeightOnlySlot in every Linear that `config.quantization` selects (a Linear whose
    layer set `keep_float = True` on it, e.g. a MoE gate, never), and the INT8/FP8 KV cache
    scales (core.quant.kv) in every attention layer."""
    if config.quantization.kv_cache_quant_algo:
        install_kv_quant(model, config.quantization.kv_cache_quant_algo)
    lq = linear_quant_of(config.quantization)
    if lq is None:
        return
    install: Callable[[Linear, LinearQuant], object] = WeightOnlySlot.install
    if lq.algo in ACT_ALGOS:  # FP8 / SmoothQuant / W4A8: activation scales too
        from bestiary.core.quant.act_slot import ActQuantSlot

        install = ActQuantSlot.install
    for path, module in model.named_modules():
        if isinstance(module, Linear) and not module.keep_float \
                and quantizes(module.name or path, config.quantization):
            install(module, lq)


def runtime_linears(model: nn.Module) -> list[Linear]:
    """The quantized Linears that run: the model's, plus the fused ones layers hold outside the
    module tree (core.quant.fuse, e.g. a gated MLP's fc + gate)."""
    fused = [m.__dict__["_fused_q"] for m in model.modules() if m.__dict__.get("_fused_q") is not None]
    return list(quantized_linears(model).values()) + fused


def set_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Run every quantized Linear's matmuls in `dtype` (float32: exact reference comparisons)."""
    for module in runtime_linears(model):
        assert module.quant is not None  # runtime_linears: quantized layers only
        module.quant.set_compute_dtype(module, dtype)


def set_max_kernel_tokens(model: nn.Module, tokens: int) -> None:
    """CPU: steps of at most `tokens` tokens use the weight-only kernels, longer ones dequantize."""
    for module in runtime_linears(model):
        assert module.quant is not None  # runtime_linears: quantized layers only
        module.quant.max_kernel_tokens = tokens
