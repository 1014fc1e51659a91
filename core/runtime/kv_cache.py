"""The paged KV cache: per-layer pools of fixed-size blocks and the block allocator.

Pools are [num_layers, num_blocks, tokens_per_block, KVH, D_k] for K and [..., KVH, D_v] for V, in the
geometry the model's config states (core.layers.kv_geometry: KVH kv heads of this rank and D_k = D_v =
head_size, or a family's own, e.g. multi-head latent attention's one latent row and D_v = 0). A
sequence owns a list of block indices (its block table); token p of the sequence lives
in block table[p // tokens_per_block] at offset p % tokens_per_block.

Block reuse (prefix caching): once a block is full, its content is named by a `BlockKey`,
the block's token ids chained with the key of the block before it, so equal keys mean an
equal whole prefix and therefore equal K/V (for causal attention with positions 0, 1, ...).
A later request whose prompt starts with the same full blocks takes them instead of
recomputing them. Blocks carry reference counts; a cached block nobody references stays in
the pool (evictable, least recently used first) until a fresh block is needed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from bestiary.core.format.errors import EnvironmentFault
from bestiary.core.format.resources import Limit, allocation_failed, available_memory, size_text
from bestiary.core.layers.kv_geometry import KVPoolGeometry, pool_geometry


def blocks_for(tokens: int, tokens_per_block: int) -> int:
    """Blocks needed to hold `tokens` tokens."""
    return -(-tokens // tokens_per_block)


class KvCacheConfig(BaseModel):
    """Runtime settings of the paged KV cache (the GPT runtime's kvCacheConfig)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(
        None, ge=1, description="Pool size in tokens (default: the engine's max_tokens_in_paged_kv_cache, "
                                "else max_batch_size * max_seq_len).")
    free_memory_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="Cap the pool at this fraction of the device's free memory "
                                          "(CUDA: free GPU memory; CPU: what this process may "
                                          "still allocate: MemAvailable, cgroup and rlimit headroom).")
    enable_block_reuse: bool = Field(True, description="Reuse the full blocks of a shared prefix across requests.")


def free_memory(device: torch.device | str) -> Limit:
    """Memory `device` has free for this process, and what limits it: CUDA's mem_get_info, or on the CPU the
    smallest of MemAvailable, the cgroup's and the rlimits' headroom (core.format.resources)."""
    device = torch.device(device)
    if device.type == "cuda":
        return Limit(torch.cuda.mem_get_info(device)[0], f"free memory of {device}")
    return available_memory()


def free_memory_bytes(device: torch.device | str) -> int:
    """free_memory(device) in bytes."""
    return free_memory(device).amount


def pool_tokens(default_tokens: int, config: KvCacheConfig, bytes_per_token: int, device: torch.device | str) -> int:
    """Pool size in tokens: config.max_tokens (or the default), capped by the memory fraction."""
    tokens = config.max_tokens or default_tokens
    if config.free_memory_fraction is not None:
        tokens = min(tokens, int(config.free_memory_fraction * free_memory_bytes(device)) // bytes_per_token)
    return tokens


FIX = ("rebuild with a smaller --max_tokens_in_paged_kv_cache (or --max_batch_size / --max_seq_len / "
       "--tokens_per_block), or pass KvCacheConfig(max_tokens=...) or free_memory_fraction")


def check_pool_fits(tokens: int, bytes_per_token: int, device: torch.device | str, tokens_per_block: int = 1) -> None:
    """Refuse a pool of `tokens` (allocated in whole blocks of `tokens_per_block`) that does not fit the
    memory `device` has free now for this process, with the numbers, the limit and the fix.

    Authoritative (the build-time check only compares with what the host could give): the pools are
    allocated lazily, so a pool larger than the free memory would fail mid-run, or not at all
    until the machine swaps."""
    rounded = blocks_for(tokens, tokens_per_block) * tokens_per_block
    need, free = rounded * bytes_per_token, free_memory(device)
    if need > free.amount:
        raise EnvironmentFault(f"the engine's KV cache of {rounded:,} tokens needs {size_text(need)}, but "
                               f"{free.gib()} is available on {device}: {FIX}")


class KVCache:
    """K and V pools for the layers of one rank (allocated lazily by the OS: torch.empty).

    `head_dim` is K's last dim, `v_dim` V's (default: head_dim; 0: no V bytes, multi-head latent attention)."""

    def __init__(self, num_layers: int, num_blocks: int, tokens_per_block: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", v_dim: int | None = None) -> None:
        shape = (num_layers, num_blocks, tokens_per_block, kv_heads, head_dim)
        v_shape = shape[:-1] + (head_dim if v_dim is None else v_dim,)
        per_token = (math.prod(shape[:1] + shape[3:]) + math.prod(v_shape[:1] + v_shape[3:])) * dtype.itemsize
        if torch.device(device).type in ("cpu", "cuda"):  # the pool as allocated: whole blocks
            check_pool_fits(num_blocks * tokens_per_block, per_token, device)
        try:
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(v_shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as err:  # the check passed, the allocator still refused
            if not allocation_failed(err):
                raise
            need = num_blocks * tokens_per_block * per_token
            raise EnvironmentFault(f"allocating the KV cache of {num_blocks * tokens_per_block:,} tokens ({need:,} bytes, "
                                   f"{size_text(need)}) on {device} failed ({free_memory(device).gib()} available): "
                                   f"{FIX}") from None
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        # (dst, src) block copies not yet replayed on the other ranks (core.runtime.step_broadcast);
        # None: no other ranks mirror this pool
        self.pending_copies: list[tuple[int, int]] | None = None

    def copy_block(self, dst: int, src: int) -> None:
        """K and V of block `src` (every layer) into block `dst`; recorded for the mirroring ranks."""
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])
        if self.pending_copies is not None:
            self.pending_copies.append((dst, src))

    @staticmethod
    def geometry_for(model) -> KVPoolGeometry:
        """The pools' per-token geometry on `model`'s tp rank (core.layers.kv_geometry.pool_geometry)."""
        return pool_geometry(model.config, model.tp_size, model.tp_rank)

    @classmethod
    def shape_for(cls, model) -> tuple[int, int, int]:
        """(local layers, kv heads of the rank, K head dim) of `model`'s pools."""
        g = cls.geometry_for(model)
        return len(model.transformer.layers), g.kv_heads, g.k_dim

    @classmethod
    def bytes_per_token_for(cls, model) -> int:
        """Bytes of K + V one token takes over all local layers of `model`."""
        element = torch.empty((), dtype=cls.dtype_for(model)).element_size()
        return len(model.transformer.layers) * cls.geometry_for(model).elements * element

    @staticmethod
    def dtype_for(model) -> torch.dtype:
        """Pool dtype: the model's, or int8 / float8_e4m3fn under an INT8 / FP8 kv_cache_quant_algo."""
        from bestiary.core.quant.kv import kv_cache_dtype

        return kv_cache_dtype(model.config, model.dtype)

    @classmethod
    def for_model(cls, model, num_blocks: int, tokens_per_block: int) -> KVCache:
        """Pools sized for `model`'s local layers in the geometry of its tp rank (geometry_for)."""
        g = cls.geometry_for(model)
        device = next(model.parameters()).device
        return cls(len(model.transformer.layers), num_blocks, tokens_per_block, g.kv_heads, g.k_dim,
                   cls.dtype_for(model), device, v_dim=g.v_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K + V one block takes over all layers."""
        return (self.k[:, 0].numel() + self.v[:, 0].numel()) * self.k.element_size()

    def commit(self) -> None:
        """Touch every page of the pools now (zeros), so their memory is resident from the start
        instead of growing as blocks are first used (a server's footprint then stays flat)."""
        self.k.zero_()
        self.v.zero_()


def fork_table(allocator: BlockAllocator, kv: KVCache, blocks: list[int], num_cached: int,
               tokens_per_block: int) -> tuple[list[int], int]:
    """A block table for a copy of a sequence holding `num_cached` tokens in `blocks`: its full
    blocks shared (one more reference each) and a fresh copy of its partial last block (K and V
    of every layer). Returns (the new table, blocks allocated: 0 or 1)."""
    full = num_cached // tokens_per_block
    table = list(blocks[:full])
    allocator.share(table)
    if num_cached % tokens_per_block == 0:
        return table, 0
    (block,) = allocator.allocate(1)
    kv.copy_block(block, blocks[full])
    return table + [block], 1


def truncate_table(allocator: BlockAllocator, blocks: list[int], num_tokens: int, tokens_per_block: int) -> int:
    """Roll a sequence back to its first `num_tokens` tokens: drop (in place) and free the blocks
    of `blocks` past blocks_for(num_tokens). Slots past num_tokens in the kept last block hold
    dead K/V that the next write overwrites. Returns the number of blocks freed."""
    keep = blocks_for(num_tokens, tokens_per_block)
    extra = blocks[keep:]
    allocator.free(extra)
    del blocks[keep:]
    return len(extra)


class BlockKey:
    """The content of a full block: its token ids and the key of the block before it.

    hash(key) = hash((hash(parent), tokens)) chains the whole prefix into one 64-bit value,
    computed once, when the block fills. Equality also compares the tokens of every block
    of the chain (stopping at the first shared parent object), so a hash collision can never
    make two different prefixes share K/V.
    """

    __slots__ = ("parent", "tokens", "_hash")

    def __init__(self, parent: BlockKey | None, tokens: tuple[Hashable, ...]) -> None:
        self.parent = parent
        self.tokens = tokens  # a block's token ids, or a root's label (the executor's adapter / window keys)
        self._hash: int = hash((parent._hash if parent is not None else 0, tokens))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        a: BlockKey | None = self
        b: object = other
        while a is not b:
            if not isinstance(a, BlockKey) or not isinstance(b, BlockKey):
                return False
            if a._hash != b._hash or a.tokens != b.tokens:
                return False
            a, b = a.parent, b.parent
        return True


@dataclass
class ReuseStats:
    """Counters of block reuse since the allocator was made."""

    lookups: int = 0  # requests whose prompt was looked up
    queried_blocks: int = 0  # full prompt blocks those lookups could have reused
    hit_blocks: int = 0  # blocks reused
    hit_tokens: int = 0  # tokens whose K/V were reused instead of computed
    evictions: int = 0  # cached blocks dropped to make room

    @property
    def hit_rate(self) -> float:
        """hit_blocks / queried_blocks (0 when nothing was queried)."""
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class BlockAllocator:
    """Reference-counted blocks; reservations guarantee admitted requests can finish.

    Every block is in exactly one state: free (no content worth keeping), referenced
    (refs > 0, in some request's block table) or cached-unreferenced (evictable, kept in LRU
    order). `num_free` counts what `allocate` can hand out: free + evictable. The executor
    reserves, at admission, every block a request may still need, so `allocate` never fails.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int = 1, enable_reuse: bool = False) -> None:
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_reuse = enable_reuse
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.reserved = 0  # blocks promised to running requests but not yet allocated
        self.num_used = 0  # blocks with refs > 0
        self.peak_used = 0
        self.stats = ReuseStats()

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks whose content is registered for reuse (referenced or not)."""
        return len(self._block_of)

    def refs(self, block: int) -> int:
        """Reference count of `block`."""
        return self._refs[block]

    def can_reserve(self, n: int) -> bool:
        """True if `n` more blocks can be promised."""
        return self.num_free - self.reserved >= n

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (refs = 1): free ones first, then evict the least recently used cached ones."""
        if n > self.num_free:
            raise RuntimeError(f"KV cache out of blocks: need {n}, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self.stats.evictions += 1
            self._refs[block] = 1
            out.append(block)
        self._count_used(n)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced cached blocks become evictable.

        The last block goes first, so a sequence's tail is evicted before its head.
        """
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"KV block {block} freed more often than taken")
            self._refs[block] = refs
            if refs == 0:
                self.num_used -= 1
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # --- reuse -------------------------------------------------------------------------
    def lookup(self, tokens: list[int], max_blocks: int,
               root: BlockKey | None = None) -> tuple[list[BlockKey], list[int]]:
        """Keys and blocks of the longest cached run of full blocks at the start of `tokens`.

        At most `max_blocks` blocks; takes no references (see `acquire`). `root` is the parent
        of the first block (a LoRA adapter's own chain: its K/V differ from the base model's).
        """
        keys: list[BlockKey] = []
        blocks: list[int] = []
        if not self.enable_reuse:
            return keys, blocks
        bs, parent = self.tokens_per_block, root
        for b in range(max_blocks):
            block = self._block_of.get(BlockKey(parent, tuple(tokens[b * bs : (b + 1) * bs])))
            if block is None:
                break
            parent = self._key_of[block]  # the stored key: later compares stop at identity
            keys.append(parent)
            blocks.append(block)
        return keys, blocks

    def shared(self, blocks: list[int]) -> int:
        """How many of `blocks` are already referenced (taking them costs no pool space)."""
        return sum(1 for b in blocks if self._refs[b] > 0)

    def acquire(self, blocks: list[int], queried: int) -> None:
        """Take a reference to cached `blocks` reused by one request (`queried` blocks were looked up)."""
        newly = 0
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
                newly += 1
            self._refs[block] += 1
        self._count_used(newly)
        self.stats.lookups += 1
        self.stats.queried_blocks += queried
        self.stats.hit_blocks += len(blocks)
        self.stats.hit_tokens += len(blocks) * self.tokens_per_block

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of the already-referenced `blocks` (a beam fork)."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise RuntimeError(f"KV block {block} shared while unreferenced")
            self._refs[block] += 1

    def register(self, block: int, key: BlockKey) -> BlockKey:
        """Record that referenced, full `block` holds `key`'s content; returns the canonical key.

        When an equal key is already cached (another request computed the same prefix at the
        same time) that block stays the cached one and this one is freed normally later.
        """
        stored = self._block_of.get(key)
        if stored is not None:
            return self._key_of[stored]
        self._block_of[key] = block
        self._key_of[block] = key
        return key

    def _count_used(self, newly: int) -> None:
        self.num_used += newly
        if self.num_used > self.peak_used:
            self.peak_used = self.num_used

    # --- invariants --------------------------------------------------------------------
    def check_whole(self) -> None:
        """Invariant for tests: no block is referenced or reserved; each is free or cached, once."""
        free, cached = set(self._free), set(self._evictable)
        problems = []
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        if free & cached:
            problems.append(f"blocks {sorted(free & cached)[:4]} are both free and cached")
        if free | cached != set(range(self.num_blocks)):
            problems.append(f"{self.num_blocks - len(free | cached)} blocks are still referenced")
        if any(self._refs) or self.num_used:
            problems.append(f"{sum(1 for r in self._refs if r)} blocks have references left")
        if set(self._key_of) != cached or len(self._block_of) != len(self._key_of):
            problems.append("the cached-block maps disagree with the evictable list")
        if self.reserved:
            problems.append(f"{self.reserved} blocks still reserved")
        if problems:
            raise AssertionError(
                f"KV pool not whole ({len(free)} free + {len(cached)} cached of {self.num_blocks}): "
                + "; ".join(problems)
            )
