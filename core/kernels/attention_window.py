"""Sliding-window attention and attention sinks: which cached keys a query sees.

A window (W, S) lets the query at cache position q see key j when

    j <= q  and  (j < S  or  q - j < W - S)        (j <= q: or j < prefix_len, prefix-LM)

S "sink" tokens (the first of the sequence, StreamingLLM) are kept forever and the W - S
most recent ones roll with the query, so a query sees at most W keys (W counts the sinks, as
a cyclic KV cache of W tokens would hold). S = 0 is HF's sliding window
(`kv_idx > q_idx - sliding_window`: W keys, the query's own included). W = 0 means no window
(every earlier key). Positions here are cache positions, never re-numbered: RoPE still sees
each token's original position.

Where a window comes from:
  - the model, per layer (`layer_window`): config `sliding_window` on every layer, or on the
    layers `layer_types` marks "sliding_attention" (interleaved full / window layers);
  - the engine or the request, for any model: `max_attention_window` (BuildConfig /
    SamplingConfig) caps every layer's window, `sink_token_length` sets S.

The effective window of (layer, sequence) is min(layer window, request window), with the
request's sinks (`effective_window`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FULL = 0  # window size meaning "no window"
SLIDING = "sliding_attention"  # HF layer_types entry of a windowed layer


def layer_window(config, layer_idx: int) -> int:
    """Window of global layer `layer_idx` from an architecture config (FULL for none).

    Reads `sliding_window` (int or None), `use_sliding_window` (False: none, Qwen2) and
    `layer_types` (HF's per-layer "sliding_attention" / "full_attention" list) when the config has them."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return FULL
    types = getattr(config, "layer_types", None)
    if types:
        return int(window) if types[layer_idx] == SLIDING else FULL
    return int(window)


def effective_window(layer: int, request: int) -> int:
    """min of two windows, FULL (0) standing for infinity."""
    if layer == FULL:
        return request
    return layer if request == FULL else min(layer, request)


def first_key(q: int, window: int, sinks: int) -> int:
    """First key of the rolling part a query at cache position q sees: max(0, q - (W - S) + 1)."""
    return 0 if window == FULL else max(0, q - (window - sinks) + 1)


def visible_keys(q_first: int, q_last: int, window: int, sinks: int) -> torch.Tensor:
    """Cache positions [K] (int64, ascending) any query in q_first..q_last may see: the sinks
    before the rolling part, then first_key(q_first) .. q_last."""
    lo = first_key(q_first, window, sinks)
    rolling = torch.arange(lo, q_last + 1)
    if window == FULL or sinks == 0 or lo == 0:
        return rolling
    return torch.cat([torch.arange(min(sinks, lo)), rolling])


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, sinks: int, prefix: int = 0) -> torch.Tensor:
    """[n, K] True where query q_pos[:, None] sees key k_pos[None, :]: causal (or within a
    prefix-LM's bidirectional `prefix`), then windowed."""
    q, k = q_pos[:, None], k_pos[None, :]
    visible = (k <= q) | (k < prefix)
    if window != FULL:
        visible = visible & ((k < sinks) | (q - k < window - sinks))
    return visible


def releasable_blocks(num_cached: int, window: int, sinks: int, block_size: int) -> range:
    """Logical blocks no query at position >= num_cached can see under window (W, S): those
    wholly past the sinks and before first_key(num_cached). Empty for FULL."""
    if window == FULL:
        return range(0)
    lo = first_key(num_cached, window, sinks)
    return range(-(-sinks // block_size), lo // block_size)


def blocks_held_at_most(window: int, sinks: int, chunk: int, block_size: int) -> int:
    """Most blocks one sequence holds during a step of `chunk` new tokens when, before the step,
    every releasable block was released: the sink blocks plus the blocks spanning the
    (W - S - 1) visible keys before the chunk and the chunk itself."""
    span = window - sinks - 1 + chunk  # keys first_key(q) .. q + chunk - 1
    return -(-sinks // block_size) + -(-(span - 1) // block_size) + 1


def check_sinks(window: int, sinks: int, what: str) -> None:
    """ValueError unless 0 <= sinks < window (window FULL: sinks must be 0)."""
    if sinks < 0:
        raise ValueError(f"sink_token_length {sinks}: expected >= 0")
    if window == FULL and sinks:
        raise ValueError(f"sink_token_length {sinks} needs an attention window ({what} has none): "
                         "set max_attention_window")
    if window != FULL and sinks >= window:
        raise ValueError(f"sink_token_length {sinks} must be smaller than the attention window {window} ({what})")


def windows_of(sizes: Sequence[int]) -> bool:
    """True when any sequence has a window."""
    return any(w != FULL for w in sizes)
