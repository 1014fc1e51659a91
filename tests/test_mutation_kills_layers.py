"""core/layers contracts that `make mutation` (tests/mutation_run.py layers_numerics) found untested.

Each test names the mutants it kills; the references are counted out in the test.
"""

from __future__ import annotations

import pytest

from bestiary.core.layers.attention_window import blocks_held_at_most


def held_by_counting(window: int, sinks: int, chunk: int, block_size: int) -> int:
    """The most blocks a long sequence holds while it runs `chunk` new tokens, over every alignment
    of the cache to the blocks: the sink blocks, plus the blocks from the one holding the first
    key the chunk's first query sees (n - (W - S) + 1) to the one holding its last token, when the
    blocks before it (past the sinks) were released."""
    most = 0
    for n in range(10 * window, 10 * window + block_size):  # every alignment, far past the sinks
        first = n - (window - sinks) + 1
        last = n + chunk - 1
        most = max(most, -(-sinks // block_size) + last // block_size - first // block_size + 1)
    return most


@pytest.mark.parametrize("window,sinks,chunk,block_size", [
    (16, 0, 1, 4), (16, 4, 1, 4), (16, 3, 5, 4), (10, 2, 7, 3), (33, 5, 16, 8), (8, 0, 1, 1), (64, 7, 1, 16),
])
def test_blocks_held_at_most_is_the_counted_maximum(window, sinks, chunk, block_size) -> None:
    """blocks_held_at_most equals the count over alignments (attention_window blocks_held_at_most
    3-16: the span's +-1 terms, ceil vs floor, the sink blocks' sign)."""
    assert blocks_held_at_most(window, sinks, chunk, block_size) == held_by_counting(window, sinks, chunk, block_size)
