"""The KV pool's bookkeeping on its own (no model): block allocator, block keys, forks of a
block table, the pool-size helpers, and the check_whole invariant each test of the executor
leans on (shown to name every broken state it claims to catch)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import bestiary.core.runtime.kv_cache as kv_cache
from bestiary.core.format.errors import EnvironmentFault
from bestiary.core.format.resources import Limit
from bestiary.core.runtime.kv_cache import (
    BlockAllocator,
    BlockKey,
    KVCache,
    KvCacheConfig,
    check_pool_fits,
    fork_table,
    free_memory,
    free_memory_bytes,
    pool_tokens,
)

GIB = 2**30


def test_free_memory_is_what_this_process_may_allocate(monkeypatch):
    """CPU: core.format.resources.available_memory (MemAvailable, cgroup and rlimit headroom, with what
    limits it); CUDA: mem_get_info's free."""
    monkeypatch.setattr(kv_cache, "available_memory", lambda: Limit(4321 * 1024, "cgroup memory.max of /x"))
    assert free_memory_bytes("cpu") == 4321 * 1024
    assert free_memory("cpu").source == "cgroup memory.max of /x"
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (123, 456))
    assert free_memory_bytes("cuda:0") == 123 and asked == [torch.device("cuda:0")]


def test_pool_tokens_caps_at_the_memory_fraction(monkeypatch):
    seen = []
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: seen.append(device) or 10_000)
    assert pool_tokens(64, KvCacheConfig(), 300, "cpu") == 64 and seen == []  # no fraction: no query
    assert pool_tokens(64, KvCacheConfig(max_tokens=40), 300, "cpu") == 40
    # 0.5 * 10000 bytes // 300 bytes a token = 16 tokens (whole tokens), below the 64 asked
    assert pool_tokens(64, KvCacheConfig(free_memory_fraction=0.5), 300, "cpu") == 16 and seen == ["cpu"]
    assert pool_tokens(8, KvCacheConfig(free_memory_fraction=0.5), 300, "cpu") == 8


def test_check_pool_fits_names_the_numbers(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_memory", lambda: Limit(3 * GIB, "RLIMIT_AS (ulimit -v)"))
    check_pool_fits(3 * 1024, 1024 * 1024, "cpu")  # exactly the free memory fits
    with pytest.raises(EnvironmentFault) as err:
        check_pool_fits(4 * 1024, 1024 * 1024, "cpu")
    msg = str(err.value)
    assert "KV cache of 4,096 tokens needs 4.0 GiB, but 3.0 GiB (RLIMIT_AS (ulimit -v)) is available on cpu" in msg
    assert "--max_tokens_in_paged_kv_cache" in msg and "KvCacheConfig(max_tokens=...) or free_memory_fraction" in msg
    with pytest.raises(EnvironmentFault, match="KV cache of 1,000,000,000 tokens"):  # the pool as allocated:
        check_pool_fits(4, 8, "cpu", tokens_per_block=10**9)  # one whole block of 10**9 tokens


def test_kv_cache_checks_the_pool_as_allocated(monkeypatch):
    """Issue 46: 4,096 tokens passed the check, then one block of 10**9 tokens asked for 256 GB."""
    monkeypatch.setattr(kv_cache, "available_memory", lambda: Limit(GIB, "cgroup memory.max of /x"))
    with pytest.raises(EnvironmentFault, match=r"KV cache of 1,000,000,000 tokens needs 7.5 GiB, but 1.0 GiB "
                                               r"\(cgroup memory.max of /x\)"):
        KVCache(1, 1, 10**9, 1, 1, torch.float32)


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 256000000000 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
])
def test_an_allocation_the_allocator_refuses_is_one_line(monkeypatch, failure):
    """The check passed (lazily allocated pages, overcommit) but the allocator still refused: one line
    naming the size and what is available, an EnvironmentFault (exit 1), not an internal error."""
    def refuse(*args, **kwargs):
        raise failure

    monkeypatch.setattr(kv_cache.torch, "empty", refuse)
    with pytest.raises(EnvironmentFault) as err:
        KVCache(2, 4, 8, 2, 16, torch.float32)
    msg = str(err.value)
    assert "allocating the KV cache of 32 tokens (16,384 bytes" in msg and "available" in msg
    assert "\n" not in msg and "--max_tokens_in_paged_kv_cache" in msg


def test_other_runtime_errors_of_the_allocation_are_not_hidden(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(kv_cache.torch, "empty", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        KVCache(2, 4, 8, 2, 16, torch.float32)


def fake_model(layers=3, heads=4, kv_heads=2, head=8, algo=None):
    """The attributes KVCache reads of a model (config, layers, tp rank, dtype, a parameter's device)."""
    quant = SimpleNamespace(kv_cache_quant_algo=algo)
    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, head_size=head,
                             quantization=quant)
    param = torch.nn.Parameter(torch.zeros(1))
    return SimpleNamespace(config=config, transformer=SimpleNamespace(layers=[None] * layers), tp_size=1, tp_rank=0,
                           dtype=torch.float32, parameters=lambda: iter([param]))


@pytest.mark.parametrize("algo,dtype", [(None, torch.float32), ("INT8", torch.int8)])
def test_pool_shapes_and_bytes_agree(algo, dtype):
    """bytes_per_token_for = the bytes one token's slot takes in pools for_model builds."""
    model = fake_model(algo=algo)
    kv = KVCache.for_model(model, num_blocks=5, tokens_per_block=1)
    assert kv.k.shape == kv.v.shape == (3, 5, 1, 2, 8) and kv.k.dtype == kv.v.dtype == dtype
    assert kv.k.device == kv.v.device == torch.device("cpu") and (kv.num_blocks, kv.tokens_per_block) == (5, 1)
    assert KVCache.bytes_per_token_for(model) == kv.bytes_per_block == (kv.k[:, 0].nbytes + kv.v[:, 0].nbytes)


def test_allocator_references_and_misuse():
    alloc = BlockAllocator(4)
    assert (alloc.tokens_per_block, alloc.enable_reuse, alloc.peak_used) == (1, False, 0)
    a = alloc.allocate(2)
    assert alloc.num_used == alloc.peak_used == 2 and alloc.num_free == 2
    assert alloc.shared(a + [3]) == 2  # block 3 is not taken
    alloc.share(a)
    assert [alloc.refs(b) for b in a] == [2, 2]
    alloc.free(a)
    assert alloc.num_used == 2 and [alloc.refs(b) for b in a] == [1, 1]
    alloc.free(a)
    assert alloc.num_used == 0 and alloc.num_free == 4 and alloc.peak_used == 2
    with pytest.raises(RuntimeError, match=f"KV block {a[1]} shared while unreferenced"):
        alloc.share([a[1]])
    with pytest.raises(RuntimeError, match=f"KV block {a[0]} freed more often than taken"):
        alloc.free([a[0]])
    assert alloc.can_reserve(4) and not alloc.can_reserve(5)
    alloc.reserved = 1
    assert alloc.can_reserve(3) and not alloc.can_reserve(4)
    alloc.reserved = 0
    alloc.allocate(4)  # exactly what is free
    with pytest.raises(RuntimeError, match="KV cache out of blocks: need 1, 0 free"):
        alloc.allocate(1)


def test_allocator_evicts_least_recently_freed_cached_block_first():
    alloc = BlockAllocator(3, tokens_per_block=2, enable_reuse=True)
    blocks = alloc.allocate(3)
    keys = [BlockKey(None, (i, i)) for i in range(3)]
    for b, k in zip(blocks, keys):
        assert alloc.register(b, k) is k
    alloc.free([blocks[1]])
    alloc.free([blocks[2]])
    alloc.free([blocks[0]])  # evictable, oldest first: 1, 2, 0
    assert alloc.num_free == 3 and alloc.num_cached == 3 and alloc.num_used == 0
    found, hit = alloc.lookup([0, 0, 5, 5], max_blocks=2)
    assert hit == [blocks[0]] and found[0] is keys[0]
    (fresh,) = alloc.allocate(1)
    assert fresh == blocks[1] and alloc.stats.evictions == 1 and alloc.num_cached == 2
    alloc.allocate(1)
    assert alloc.stats.evictions == 2
    alloc.acquire([blocks[0]], queried=2)
    alloc.acquire([blocks[0]], queried=1)
    s = alloc.stats
    assert (s.lookups, s.queried_blocks, s.hit_blocks, s.hit_tokens) == (2, 3, 2, 4)
    assert alloc.refs(blocks[0]) == 2 and alloc.num_used == 3 and alloc.peak_used == 3


def test_block_keys_compare_whole_prefixes():
    a = BlockKey(None, (1, 2))
    b = BlockKey(a, (3, 4))
    assert (a.parent, a.tokens, b.parent, b.tokens) == (None, (1, 2), a, (3, 4))
    assert hash(a) == hash((0, (1, 2))) and hash(b) == hash((hash(a), (3, 4)))
    assert BlockKey(BlockKey(None, (1, 2)), (3, 4)) == b  # equal chains, other objects
    assert b != BlockKey(BlockKey(None, (9, 2)), (3, 4))  # same last block, other parent
    assert b != BlockKey(None, (3, 4)) and BlockKey(None, (3, 4)) != b and b != (3, 4)
    twin = BlockKey(a, (4, 3))
    twin._hash = b._hash  # a hash collision must not make other tokens equal
    assert twin != b and b == b


def test_fork_table_shares_full_blocks_and_copies_the_partial_one():
    alloc, kv = BlockAllocator(6), KVCache(2, 6, 4, 1, 3, torch.float32)
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    src = alloc.allocate(3)  # 10 tokens: 2 full blocks and 2 tokens in the third
    table, copied = fork_table(alloc, kv, src, 10, 4)
    assert copied == 1 and table[:2] == src[:2] and table[2] not in src and len(table) == 3
    assert [alloc.refs(b) for b in src] == [2, 2, 1] and alloc.refs(table[2]) == 1 and alloc.num_used == 4
    assert torch.equal(kv.k[:, table[2]], kv.k[:, src[2]]) and torch.equal(kv.v[:, table[2]], kv.v[:, src[2]])
    full, none = fork_table(alloc, kv, src[:2], 8, 4)  # no partial block: nothing to copy
    assert (full, none) == (src[:2], 0) and [alloc.refs(b) for b in src[:2]] == [3, 3] and alloc.num_used == 4


def test_check_whole_names_every_broken_state():
    def broken(change) -> str:
        alloc = BlockAllocator(6, enable_reuse=True)
        change(alloc)
        with pytest.raises(AssertionError) as err:
            alloc.check_whole()
        return str(err.value)

    BlockAllocator(4).check_whole()
    msg = broken(lambda a: a.allocate(1))
    assert msg == "KV pool not whole (5 free + 0 cached of 6): 1 blocks are still referenced; 1 blocks have references left"
    assert "a block is on the free list twice" in broken(lambda a: a._free.append(a._free[0]))
    assert "2 blocks still reserved" in broken(lambda a: setattr(a, "reserved", 2))
    assert "blocks [0] are both free and cached" in broken(lambda a: a._evictable.__setitem__(0, None))
    assert "blocks [0, 1, 2, 3] are both" in broken(lambda a: a._evictable.update(dict.fromkeys(range(6))))
    assert "the cached-block maps disagree" in broken(lambda a: a._block_of.__setitem__(BlockKey(None, (0,)), 0))
    assert "the cached-block maps disagree" in broken(lambda a: a._key_of.__setitem__(0, BlockKey(None, (0,))))
    assert "blocks have references left" in broken(lambda a: setattr(a, "num_used", 1))
