"""The two-level LoRA cache: LRU eviction per level, held adapters never evicted, both budgets,
an unknown task id failing its request alone, and 50 adapters cycling through a cache of 4."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import parity  # noqa: E402
from lora_helpers import tiny_llama  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.lora.request import LoraRequest  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

GREEDY = SamplingConfig(temperature=0, max_new_tokens=5, ignore_eos=True)
PROMPT = [5, 17, 60, 3, 42, 9, 11]


def seed_adapter(seed: int, rank: int = 2) -> LoraRequest:
    """Task `seed`: TensorRT-LLM's LoRA tensors for a random rank-`rank` adapter on q and v of both layers."""
    gen = torch.Generator().manual_seed(seed)
    rows, config = [], []
    for layer in range(2):
        for module_id, out in ((1, 64), (3, 32)):  # attn_q: 4 heads x 16, attn_v: 2 kv heads x 16
            a = torch.randn(rank, 64, generator=gen) / 8
            b = torch.randn(out, rank, generator=gen)
            rows.append(torch.cat([a.flatten(), b.flatten()]))
            config.append([module_id, layer, rank])
    width = max(r.numel() for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    return LoraRequest(seed, weights=weights.numpy(), config=np.array(config, dtype=np.int32))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cache")
    convert(parity.save_hf(tiny_llama(), root), root / "ckpt", ConvertOptions(dtype="float32"), show_progress=False)
    return root / "ckpt"


@pytest.fixture(scope="module")
def sizes(ckpt):
    """(host, device) bytes of one adapter."""
    llm = LLM(ckpt)
    llm.lora_store.get(seed_adapter(0))
    return llm.lora_store.host.used, llm.lora_store.device.used


def _llm(ckpt, host: int, device: int) -> LLM:
    return LLM(ckpt, lora_cache_config={"host_cache_size": host, "device_cache_size": device})


def test_eviction_is_least_recently_used(ckpt, sizes):
    host, device = sizes
    cache = _llm(ckpt, 2 * host, 2 * device).lora_store
    a = cache.get(seed_adapter(1))
    cache.get(seed_adapter(2))
    assert cache.get(LoraRequest(1)) is a  # 1 is now the most recently used
    cache.get(seed_adapter(3))  # evicts 2, the least recently used
    assert list(cache.host.entries) == ["1", "3"] and list(cache.device.entries) == ["1", "3"]
    cache.check_accounting()
    with pytest.raises(BestiaryError, match="LoRA task '2' is not cached: its first request must bring the weights"):
        cache.get(LoraRequest(2))


def test_adapters_in_use_are_never_evicted(ckpt, sizes):
    host, device = sizes
    cache = _llm(ckpt, 2 * host, 2 * device).lora_store
    a, _ = cache.take(seed_adapter(1)), cache.take(seed_adapter(2))
    with pytest.raises(BestiaryError, match=r"LoRA task '3': the host cache is full \(2 adapters in use"):
        cache.get(seed_adapter(3))
    assert list(cache.host.entries) == ["1", "2"]
    cache.release(a)
    cache.get(seed_adapter(3))  # now 1, unused, goes
    assert list(cache.host.entries) == ["2", "3"] and set(cache.held) == {"2"}
    cache.check_accounting()
    with pytest.raises(BestiaryError, match="needs .* more than the host cache's"):
        _llm(ckpt, host - 1, 2 * device).lora_store.get(seed_adapter(1))


def test_each_level_keeps_its_own_budget(ckpt, sizes):
    """Host for 3, device for 2: the device level evicts; an id alone is placed again from the host copy."""
    host, device = sizes
    cache = _llm(ckpt, 3 * host, 2 * device).lora_store
    first = cache.get(seed_adapter(1))
    cache.get(seed_adapter(2))
    cache.get(seed_adapter(3))
    assert list(cache.host.entries) == ["1", "2", "3"] and list(cache.device.entries) == ["2", "3"]
    again = cache.get(LoraRequest(1))  # from the host level, no weights brought
    assert again is not first and again.uid != first.uid
    assert all(torch.equal(p.b, q.b) for k in first.pieces for p, q in zip(first.pieces[k], again.pieces[k]))
    assert list(cache.device.entries) == ["3", "1"]
    assert cache.host.used == 3 * host <= cache.host.budget and cache.device.used == 2 * device <= cache.device.budget
    cache.check_accounting()


def test_device_budget_defaults(monkeypatch):
    """The device level's budget: device_cache_size when given; on CUDA, device_cache_percent of
    the free memory torch.cuda.mem_get_info reports after load; on the CPU, the host budget."""
    from bestiary.core.lora.cache import LoraCache, LoraCacheConfig

    class OnDevice(torch.nn.Module):  # parameters() reports `device`, allocates nothing there
        def __init__(self, device: str) -> None:
            super().__init__()
            self.device = torch.device(device)

        def parameters(self, recurse: bool = True):
            yield type("P", (), {"device": self.device})()

    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(d) or (8 << 30, 80 << 30))
    config = LoraCacheConfig(host_cache_size=1 << 20, device_cache_percent=0.05)
    assert LoraCache(OnDevice("cuda:1"), config=config).device.budget == int(0.05 * (8 << 30))
    assert asked == [torch.device("cuda:1")]
    assert LoraCache(OnDevice("cpu"), config=config).device.budget == 1 << 20
    sized = LoraCacheConfig(host_cache_size=1 << 20, device_cache_size=12345)
    assert LoraCache(OnDevice("cuda:0"), config=sized).device.budget == 12345 and len(asked) == 1


def test_an_unknown_task_id_fails_only_its_request(ckpt):
    llm = LLM(ckpt)
    want = {i: llm.generate([PROMPT], GREEDY, lora=seed_adapter(i))[0].output_ids for i in (1, 2)}

    async def one(lora):
        return [t for d in [d async for d in llm.generate_async(PROMPT, GREEDY, lora=lora)] for t in d.token_ids]

    async def together():
        return await asyncio.gather(one(LoraRequest(1)), one(LoraRequest("nope")), one(seed_adapter(2)),
                                    return_exceptions=True)

    first, unknown, second = asyncio.run(together())
    assert isinstance(unknown, BestiaryError) and "LoRA task 'nope' is not cached" in str(unknown)
    assert (first, second) == (want[1], want[2])
    # one LoraRequest for several prompts holds once per prompt, n samples once per sample, and a
    # request refused by the executor gives its hold back
    assert len({tuple(c.output_ids) for c in llm.generate([PROMPT] * 3, GREEDY, lora=LoraRequest(1))}) == 1
    llm.generate([PROMPT], SamplingConfig(temperature=1.0, n=3, max_new_tokens=3, random_seed=1),
                 lora=LoraRequest(1))
    with pytest.raises(BestiaryError, match="exceeds the engine's max_input_len"):
        llm.generate([PROMPT, list(range(1, 90)) * 20], GREEDY, lora=[LoraRequest(1), LoraRequest(2)])
    assert not llm.lora_store.held and not llm.executor.has_work
    llm.lora_store.check_accounting()


def test_50_adapters_through_a_cache_of_4_give_unchanged_outputs(ckpt, sizes):
    host, device = sizes
    ref = LLM(ckpt)
    ids = list(range(50))
    want = [c.output_ids for c in ref.generate([PROMPT] * 50, GREEDY, lora=[seed_adapter(i) for i in ids])]
    assert len({tuple(w) for w in want}) > 40, "the adapters must give different outputs"
    llm = _llm(ckpt, 4 * host, 4 * device)
    cache = llm.lora_store
    for cycle in range(2):
        for start in range(0, 50, 4):
            batch = ids[start : start + 4]
            got = [c.output_ids for c in llm.generate([PROMPT] * len(batch), GREEDY,
                                                      lora=[seed_adapter(i) for i in batch])]
            assert got == want[start : start + 4], f"cycle {cycle}, adapters {batch}"
            again = [c.output_ids for c in llm.generate([PROMPT] * len(batch), GREEDY,
                                                        lora=[LoraRequest(i) for i in batch])]  # ids alone: cached
            assert again == got
            assert len(cache.host.entries) <= 4 and not cache.held
            cache.check_accounting()
    assert list(cache.host.entries) == ["46", "47", "48", "49"]  # least recently used first
    with pytest.raises(BestiaryError, match="LoRA task '0' is not cached"):
        llm.generate([PROMPT], GREEDY, lora=LoraRequest(0))
