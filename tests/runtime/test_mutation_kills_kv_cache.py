"""KV pool contracts that `make mutation` (tests/mutation_run.py kv_cache) found untested.

Each test names the mutants of core/runtime/kv_cache.py it kills. The pools go on the meta
device, so a pool put on the default device instead (the CPU here) is visible without a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bestiary.core.runtime.kv_cache import BlockAllocator, KVCache, truncate_table


def fake_model(dtype: torch.dtype) -> SimpleNamespace:
    """What KVCache.for_model reads: config, tp rank, local layers, dtype, a parameter's device."""
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_size=8,
                             quantization=SimpleNamespace(kv_cache_quant_algo=None))
    return SimpleNamespace(config=config, tp_size=1, tp_rank=0, dtype=dtype,
                           transformer=SimpleNamespace(layers=[None] * 3),
                           parameters=lambda: iter([torch.empty(1, device="meta")]))


def test_pools_follow_the_model_device_and_dtype() -> None:
    """K and V on the device asked for (__init__ 7, 10, 14, 17: device None / default) and, from
    for_model, on the model's device in its dtype (for_model 3, 11, 18; dtype_for 2: dtype None
    gives torch's default float32 instead of the model's bf16)."""
    kv = KVCache(2, 3, 4, 1, 8, torch.float16, torch.device("meta"))
    assert kv.k.device.type == kv.v.device.type == "meta"
    kv = KVCache.for_model(fake_model(torch.bfloat16), num_blocks=5, tokens_per_block=4)
    assert kv.k.device.type == kv.v.device.type == "meta"
    assert kv.k.dtype == kv.v.dtype == torch.bfloat16
    assert kv.k.shape == (3, 5, 4, 2, 8)


def test_copy_block_records_the_copy_for_mirroring_ranks() -> None:
    """With pending_copies on, copy_block records (dst, src) (copy_block 4: None recorded)."""
    kv = KVCache(1, 3, 2, 1, 2, torch.float32)
    kv.k.normal_(), kv.v.normal_()
    kv.pending_copies = []
    kv.copy_block(2, 0)
    assert kv.pending_copies == [(2, 0)]
    assert torch.equal(kv.k[:, 2], kv.k[:, 0]) and torch.equal(kv.v[:, 2], kv.v[:, 0])


def test_truncate_table_frees_the_blocks_past_the_kept_tokens() -> None:
    """Rolling 9 tokens (3 blocks of 4) back to 5 keeps blocks_for(5, 4) = 2 blocks and frees the
    third (truncate_table 1-7); back to 8 keeps 2 and frees none more."""
    alloc = BlockAllocator(6, tokens_per_block=4)
    blocks = alloc.allocate(3)
    third = blocks[2]
    free_before = alloc.num_free
    assert truncate_table(alloc, blocks, 5, 4) == 1
    assert len(blocks) == 2 and third not in blocks
    assert alloc.num_free == free_before + 1
    assert truncate_table(alloc, blocks, 8, 4) == 0 and len(blocks) == 2
