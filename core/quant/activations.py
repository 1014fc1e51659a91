"""Input statistics of every Linear, measured while a float model runs over calibration tokens.

For a Linear y = x W^T (W [N, K]) and calibration inputs x_t [K], t = 1..T:

    absmax[k] = max_t |x_t[k]|          (the per-channel range AWQ and SmoothQuant scale by)
    amax      = max_k absmax[k]         (per-tensor range: FP8 / int8 activation scales)
    hessian   = sum_t x_t x_t^T  [K, K] (the layer's proxy Hessian: the output error of a weight
                                         error dW is sum_t |dW x_t|^2 = trace(dW H dW^T))

Collected with forward pre-hooks on each `Linear` (keyed by its canonical `linear.name`), while
the model runs the tokens in chunks of at most `chunk` tokens, each chunk one sequence from
position 0 (every token goes through lm_head as well: all_logits). The model must be unfused
(no `prepare_for_inference`), so fused fc/gate matmuls still go through their `Linear`s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

DEFAULT_CHUNK = 512


@dataclass
class LinearInputStats:
    """What the inputs of one Linear looked like over the calibration tokens (module docstring)."""

    absmax: torch.Tensor  # float32 [K]
    amax: float
    hessian: torch.Tensor | None  # float32 [K, K] = sum_t x_t x_t^T, or None when not collected
    tokens: int


class _Accumulator:
    """Running absmax / hessian of one Linear's inputs."""

    def __init__(self, hessian: bool) -> None:
        self.with_hessian = hessian
        self.absmax: torch.Tensor | None = None
        self.hessian: torch.Tensor | None = None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).float()  # [T, K]
        amax = x2.abs().amax(dim=0)  # [K]
        self.absmax = amax if self.absmax is None else torch.maximum(self.absmax, amax)
        if self.with_hessian:
            xtx = x2.t() @ x2  # [K, K]
            self.hessian = xtx if self.hessian is None else self.hessian.add_(xtx)
        self.tokens += x2.shape[0]

    def stats(self) -> LinearInputStats:
        assert self.absmax is not None
        return LinearInputStats(self.absmax, float(self.absmax.max()), self.hessian, self.tokens)


def run_sequence(model: nn.Module, ids: list[int], all_logits: bool, block_size: int = 32):
    """Run `ids` as one sequence from position 0 through a private, zeroed float KV cache; returns
    (logits [len(ids), V] with `all_logits`, else [1, V]; the KVCache holding the sequence's K and V)."""
    from bestiary.core.runtime.kv_cache import KVCache, blocks_for
    from bestiary.core.runtime.model import sequence_metadata

    blocks = list(range(blocks_for(len(ids), block_size)))
    kv = KVCache.for_model(model, len(blocks), block_size)
    kv.k.zero_()
    kv.v.zero_()
    meta = sequence_metadata(model, ids, 0, len(ids), blocks, block_size)
    return model(torch.tensor(ids), meta, kv, all_logits=all_logits), kv


def chunk_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of `ids` as one sequence from position 0, through a private float KV cache."""
    return run_sequence(model, ids, all_logits=True)[0]


def calibration_chunks(model: nn.Module, ids: list[int], chunk: int = DEFAULT_CHUNK) -> list[list[int]]:
    """`ids` cut into sequences of at most `chunk` tokens (and the model's max_position_embeddings)."""
    limit = getattr(model.config, "max_position_embeddings", None) or chunk
    chunk = max(1, min(chunk, limit))
    return [ids[start:start + chunk] for start in range(0, len(ids), chunk)]


def run_chunks(model: nn.Module, ids: list[int], chunk: int = DEFAULT_CHUNK,
               on_chunk: Callable[[], None] | None = None,
               on_logits: Callable[[torch.Tensor], None] | None = None) -> None:
    """Run `model` (float KV cache) over `ids` in sequences of at most `chunk` tokens (all logits);
    `on_logits(logits [T, V])` sees each sequence's logits."""
    for part in calibration_chunks(model, ids, chunk):
        logits = chunk_logits(model, part)
        if on_logits is not None:
            on_logits(logits)
        if on_chunk is not None:
            on_chunk()


@torch.inference_mode()
def collect_linear_inputs(
    model: nn.Module,
    ids: list[int],
    hessian: bool,
    names: set[str] | None = None,
    chunk: int = DEFAULT_CHUNK,
    on_chunk: Callable[[], None] | None = None,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> dict[str, LinearInputStats]:
    """linear.name -> LinearInputStats of every Linear of `model` (or those in `names`) over `ids`.

    `hessian`: also accumulate sum_t x_t x_t^T (float32 [K, K] per layer); `on_logits`: sees each
    calibration sequence's logits [T, V] (the float model's, e.g. as a distillation target)."""
    from bestiary.core.layers.linear import Linear

    accs: dict[str, _Accumulator] = {}
    handles = []
    for path, module in model.named_modules():
        name = (module.name or path) if isinstance(module, Linear) else None
        if name is None or (names is not None and name not in names):
            continue
        acc = accs[name] = _Accumulator(hessian)
        handles.append(module.register_forward_pre_hook(lambda _m, args, acc=acc: acc.add(args[0])))
    try:
        run_chunks(model, ids, chunk, on_chunk, on_logits)
    finally:
        for h in handles:
            h.remove()
    return {name: acc.stats() for name, acc in accs.items() if acc.tokens}
