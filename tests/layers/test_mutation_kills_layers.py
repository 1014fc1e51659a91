"""core/layers contracts that `make mutation` (tests/mutation_run.py layers_numerics) found untested.

Each test names the mutants it kills; the references are counted out in the test.
"""

from __future__ import annotations

import pytest

from bestiary.core.kernels.attention_window import blocks_held_at_most


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


def test_norm_layers_hold_frozen_parameters_of_the_asked_dtype_and_device() -> None:
    """RMSNorm / LayerNorm: default eps 1e-6 (LLaMA's) / 1e-5 (OPT's, torch's), LayerNorm with a bias
    unless told otherwise; weight (and bias) of hidden_size in the asked dtype and on the asked
    device, frozen (norm RMSNorm.__init__ 1-13, LayerNorm.__init__ 1-28: defaults, requires_grad,
    dtype, device)."""
    import torch

    from bestiary.core.layers.norm import LayerNorm, RMSNorm

    assert RMSNorm(6).eps == 1e-6 and LayerNorm(6).eps == 1e-5
    assert LayerNorm(6, bias=False).bias is None
    for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "meta")):
        norms = (RMSNorm(6, dtype=dtype, device=device), LayerNorm(6, dtype=dtype, device=device))
        params = [norms[0].weight, norms[1].weight, norms[1].bias]
        assert all(p.shape == (6,) and p.dtype == dtype and p.device.type == device and not p.requires_grad
                   for p in params)
    default = (RMSNorm(6).weight, LayerNorm(6).weight, LayerNorm(6).bias)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in default)


def test_rank_alibi_slopes_are_the_ranks_share_on_the_cpu() -> None:
    """rank_alibi_slopes: by default (rank 0 of 1) every head's slope; rank r of tp holds heads
    r H / tp .. (r + 1) H / tp; a tp that does not divide the heads is refused naming both; float32
    on the CPU even where the default device is meta (alibi rank_alibi_slopes 1, 2, 4, 14)."""
    import torch

    from bestiary.core.layers.alibi import rank_alibi_slopes
    from bestiary.core.layers.attention import alibi_slopes

    every = alibi_slopes(12)
    assert torch.equal(rank_alibi_slopes(12), every)
    for rank in range(3):
        assert torch.equal(rank_alibi_slopes(12, rank, 3), every[4 * rank : 4 * rank + 4])
    with pytest.raises(ValueError, match="tp_size 5 must divide num_attention_heads 12"):
        rank_alibi_slopes(12, 0, 5)
    with torch.device("meta"):
        slopes = rank_alibi_slopes(8, 1, 2)
    assert slopes.device.type == "cpu" and slopes.dtype == torch.float32 and slopes.shape == (4,)


def test_learned_position_embedding_holds_a_frozen_table_with_its_offset() -> None:
    """LearnedPositionEmbedding: a table of num_positions + offset rows (OPT's offset 2), in the asked
    dtype and on the asked device, frozen (position_embedding __init__ 7, 10, 11, 14, 15, 17)."""
    import torch

    from bestiary.core.layers.position_embedding import LearnedPositionEmbedding

    for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "meta")):
        table = LearnedPositionEmbedding(10, 4, offset=2, dtype=dtype, device=device).weight
        assert table.shape == (12, 4) and table.dtype == dtype and table.device.type == device
        assert not table.requires_grad
    assert LearnedPositionEmbedding(10, 4).weight.shape == (10, 4)
