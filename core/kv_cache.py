"""The paged KV cache: per-layer pools of fixed-size blocks and the block allocator.

Pools are [num_layers, num_blocks, tokens_per_block, KVH, D] for K and for V. A
sequence owns a list of block indices (its block table); token p of the sequence lives
in block table[p // tokens_per_block] at offset p % tokens_per_block.
"""

from __future__ import annotations

import torch


def blocks_for(tokens: int, tokens_per_block: int) -> int:
    """Blocks needed to hold `tokens` tokens."""
    return -(-tokens // tokens_per_block)


class KVCache:
    """K and V pools for the layers of one rank (allocated lazily by the OS: torch.empty)."""

    def __init__(self, num_layers: int, num_blocks: int, tokens_per_block: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_blocks, tokens_per_block, kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks

    @classmethod
    def for_model(cls, model, num_blocks: int, tokens_per_block: int) -> "KVCache":
        """Pools sized for `model`'s local layers and the kv heads its tp rank holds."""
        from bestiary.core.layers.self_attention import kv_heads_of_rank

        cfg = model.config
        kv_heads = len(kv_heads_of_rank(cfg.num_attention_heads, cfg.num_key_value_heads, model.tp_size, model.tp_rank))
        device = next(model.parameters()).device
        return cls(len(model.transformer.layers), num_blocks, tokens_per_block, kv_heads, cfg.head_size,
                   model.dtype, device)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K + V one block takes over all layers."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()


class BlockAllocator:
    """Free list of block indices; reservations guarantee admitted requests can finish."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.reserved = 0  # blocks promised to running requests but not yet allocated

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_reserve(self, n: int) -> bool:
        """True if `n` more blocks can be promised."""
        return self.num_free - self.reserved >= n

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the free list."""
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {n}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Give blocks back."""
        self._free.extend(reversed(blocks))

    def check_whole(self) -> None:
        """Invariant for tests: every block is free again and nothing is reserved."""
        if sorted(self._free) != list(range(self.num_blocks)) or self.reserved:
            raise AssertionError(
                f"KV pool not whole: {self.num_free}/{self.num_blocks} free, {self.reserved} reserved"
            )
