"""Attention windows in the paged KV cache: which window a request runs under, and releasing the
blocks that fall out of it.

A request's window (core.kernels.attention_window) comes from its SamplingConfig, else the
engine's BuildConfig (`max_attention_window`, `sink_token_length`); each layer narrows it to its
own sliding window. A block can go back to the pool once no later query of any layer can see it:
it lies wholly past the sinks and before the first key the widest layer window still shows the
next query. Its table entry becomes RELEASED (the table keeps its length: token p still lives
in entry p // tokens_per_block) and its reference is dropped; a full block registered for
prefix reuse stays cached (evictable), so a later request with the same prefix still finds it.

A request under window W then holds, during a step of c new tokens, at most

    ceil(S / bs) + ceil((W - S + c - 2) / bs) + 1        blocks (c = 1: ceil(W / bs) + 1 + sinks)

(`attention_window.blocks_held_at_most`), which is what admission reserves instead of its whole length.
"""

from __future__ import annotations

from bestiary.core.format.errors import BestiaryError
from bestiary.core.kernels.attention_window import FULL, check_sinks, effective_window, releasable_blocks
from bestiary.core.runtime.kv_cache import BlockAllocator

RELEASED = -1  # block table entry of a block released out of the window


def request_window(sampling, build) -> tuple[int, int]:
    """(window, sinks) a request runs under: its own settings, else the engine's (window 0: none).

    BestiaryError for a window wider than the engine's max_attention_window."""
    engine_window = getattr(build, "max_attention_window", None) or FULL
    window = sampling.max_attention_window or engine_window
    if engine_window != FULL and window > engine_window:
        raise BestiaryError(f"max_attention_window {window} exceeds the engine's max_attention_window {engine_window}")
    sinks = sampling.sink_token_length
    return window, getattr(build, "sink_token_length", 0) if sinks is None else sinks


def release_window(layer_windows: list[int], window: int, sinks: int) -> int:
    """The window blocks are released under: the widest of the layers' effective windows, FULL
    (nothing released) when any layer sees every key. BestiaryError for sinks >= a window, or
    sinks without any window."""
    effective = [effective_window(w, window) for w in layer_windows]
    finite = [w for w in effective if w != FULL]
    try:
        check_sinks(min(finite) if finite else FULL, sinks, "the model and the request")
    except ValueError as err:
        raise BestiaryError(str(err)) from None
    return FULL if not finite or len(finite) < len(effective) else max(finite)


def held(blocks: list[int]) -> list[int]:
    """The blocks of a table still held (not RELEASED)."""
    return [b for b in blocks if b != RELEASED]


def release_outside(allocator: BlockAllocator, blocks: list[int], num_cached: int, window: int, sinks: int,
                    block_size: int) -> int:
    """Release (in place) the blocks of `blocks` no query at position >= num_cached sees under
    (window, sinks); returns how many were released. Earlier ones were released by earlier
    calls, so the walk goes back from the newest releasable block to the first RELEASED one."""
    released = []
    for b in reversed(releasable_blocks(num_cached, window, sinks, block_size)):
        if blocks[b] == RELEASED:
            break
        released.append(blocks[b])
        blocks[b] = RELEASED
    allocator.free(released)
    return len(released)
