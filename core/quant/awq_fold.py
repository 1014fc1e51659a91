"""AWQ scales for weight-only int4, folded into the op that produces each scaled linear's input.

For y = x W^T, the weight W diag(s) and the input x / s give the same y, but the scaled weight
rounds differently: input channels that carry large activations get a finer effective step
(AWQ, Lin et al. 2023). Weight-only int4 (W4A16) has no activation scale at run time, so 1/s is
folded into what produces x, exactly, where the layer structure allows it:

    producer (divided by s)                       consumer (columns times s)
    input_layernorm weight (and bias)        ->   attention.qkv
    post_layernorm weight (and bias)         ->   mlp.fc and mlp.gate (one s for both)
    mlp.gate rows (and bias)                 ->   mlp.proj   (GatedMLP: proj reads act(fc) * gate,
                                                               linear in gate's output)

The scale: s = rms^alpha normalised to max(s) min(s) = 1, rms_k = sqrt(H_kk / T) of the
consumer's input; alpha on a grid of 20 minimises the summed output error of the consumers,
sum_i trace(dW_i H dW_i^T), with round to nearest (core.quant.awq.search_shared_scale; alpha = 0
is s = 1). The consumers' statistics become those of x / s (H' = diag(1/s) H diag(1/s)), and
GPTQ then quantizes W diag(s) with them.

Folds are only made where the model is built from the shared layers that make them exact
(PreNormDecoderLayer with RMSNorm / LayerNorm norms, SelfAttention's qkv, GatedMLP) and the
consumers are quantized; everything else keeps s = 1. Measured on SmolLM2-135M (W4A16 g64,
zero points, lm_head float): GPTQ with clip search +16.6% perplexity, with the folded AWQ scales
+11.2% (docs/quantization.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from bestiary.core.quant.awq import search_shared_scale
from bestiary.core.quant.input_stats import LinearInputStats


@dataclass(frozen=True)
class ScaleFold:
    """Divide `producers` (tensor keys, along dim 0) by s and multiply `consumers`' columns by s."""

    producers: tuple[str, ...]
    consumers: tuple[str, ...]  # weight keys of quantized linears reading the same input


def _norm_keys(path: str, norm: nn.Module) -> tuple[str, ...] | None:
    from bestiary.core.layers.norm import LayerNorm, RMSNorm

    if type(norm) not in (RMSNorm, LayerNorm):
        return None
    return (f"{path}.weight",) + ((f"{path}.bias",) if getattr(norm, "bias", None) is not None else ())


def scale_folds(model: nn.Module, quantized: set[str]) -> list[ScaleFold]:
    """The exact folds of `model` (module docstring) whose consumers' weight keys are all in `quantized`."""
    from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
    from bestiary.core.layers.mlp import GatedMLP
    from bestiary.core.layers.self_attention import SelfAttention

    folds = []

    def add(producers: tuple[str, ...] | None, consumers: tuple[str, ...]) -> None:
        if producers and all(c in quantized for c in consumers):
            folds.append(ScaleFold(producers, consumers))

    for path, layer in model.named_modules():
        if type(layer) is not PreNormDecoderLayer:
            continue
        if isinstance(layer.attention, SelfAttention):
            add(_norm_keys(f"{path}.input_layernorm", layer.input_layernorm), (f"{path}.attention.qkv.weight",))
        if type(layer.mlp) is GatedMLP:
            mlp = f"{path}.mlp"
            add(_norm_keys(f"{path}.post_layernorm", layer.post_layernorm), (f"{mlp}.fc.weight", f"{mlp}.gate.weight"))
            gate = (f"{mlp}.gate.weight",) + ((f"{mlp}.gate.bias",) if layer.mlp.gate.bias is not None else ())
            add(gate, (f"{mlp}.proj.weight",))
    return folds


def scaled_stats(stats: LinearInputStats, s: torch.Tensor) -> LinearInputStats:
    """The statistics of x / s [K] from those of x."""
    hessian = None if stats.hessian is None else stats.hessian / s[:, None] / s[None, :]
    absmax = stats.absmax / s
    return LinearInputStats(absmax, float(absmax.max()), hessian, stats.tokens)


def fold_awq_scales(
    tensors: dict[str, torch.Tensor],
    folds: list[ScaleFold],
    stats: dict[str, LinearInputStats],
    names: dict[str, str],
    quantize: Callable[[str, torch.Tensor], torch.Tensor],
    on_fold: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Search and fold each fold's scale into `tensors` in place; update `stats` (by linear name) to the
    scaled inputs. `names`: weight key -> linear name; `quantize(key, W)`: W's round-to-nearest
    quantize-dequantize as the key's layer stores it; `on_fold`: called after each fold (progress).
    Returns weight key -> s of the folds made."""
    made: dict[str, torch.Tensor] = {}
    for fold in folds:
        if on_fold is not None:
            on_fold()
        first = stats.get(names[fold.consumers[0]])
        if first is None or first.hessian is None or first.tokens == 0:
            continue
        rms = (torch.diagonal(first.hessian).clamp(min=0) / first.tokens).sqrt()  # [K]
        weights = [tensors[key] for key in fold.consumers]
        s = search_shared_scale(weights, first.hessian, rms, functools.partial(quantize, fold.consumers[0]))  # [K]
        if bool((s == 1).all()):
            continue
        for key in fold.consumers:
            tensors[key] = (tensors[key].float() * s[None, :]).to(tensors[key].dtype)
            stats[names[key]] = scaled_stats(stats[names[key]], s)
            made[key] = s
        for key in fold.producers:
            t = tensors[key]
            tensors[key] = (t.float() / s.view(-1, *([1] * (t.dim() - 1)))).to(t.dtype)
    return made
