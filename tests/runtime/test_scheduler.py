"""In-flight batching at scale, KV block reuse across requests, eviction, memory accounting.

Every workload here checks, after every step, that the blocks in use never exceed the tokens
held rounded up to whole blocks (`check_kv_accounting`), and at the end that the pool is
whole again (`check_whole`).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.format.build_config import BuildConfig, finalize_build_config  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.executor import Executor, supports_block_reuse  # noqa: E402
from bestiary.core.runtime.kv_cache import KvCacheConfig  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    base = tmp_path_factory.mktemp("sched")
    convert(make_tiny_llama(base, max_position_embeddings=1024), base / "ckpt", show_progress=False)
    return Engine.load(base / "ckpt")


def executor(engine, reuse: bool = True, **limits) -> Executor:
    build = finalize_build_config(BuildConfig(tokens_per_block=BLOCK, max_seq_len=600, **limits),
                                  engine.config.model_dump())
    return Executor(engine.model, build, kv_cache_config=KvCacheConfig(enable_block_reuse=reuse))


def run_checked(ex: Executor, arrivals: list[tuple[int, list[int], int]]) -> list:
    """Add (step, prompt, max_new_tokens) at their steps; step to the end checking the KV accounting."""
    pending = sorted(arrivals, key=lambda a: a[0])
    requests, step = [], 0
    while pending or ex.has_work:
        while pending and pending[0][0] <= step:
            _, prompt, n = pending.pop(0)
            requests.append(ex.add(prompt, SamplingConfig(max_new_tokens=n, **GREEDY)))
        ex.step()
        ex.check_kv_accounting()
        step += 1
    ex.allocator.check_whole()
    return requests


def alone(engine, prompt: list[int], n: int) -> list[int]:
    ex = executor(engine, reuse=False)
    (req,) = run_checked(ex, [(0, prompt, n)])
    return req.output


def test_32_request_mixed_workload_equals_each_alone(engine):
    """Prompts 4..400, max_new_tokens 8..128, arriving at different steps, batch 8, 128 tokens per
    step (chunked prefill beside decodes): each request gets exactly the tokens it gets alone."""
    rng = random.Random(7)
    arrivals = [(rng.randrange(0, 200), [rng.randrange(96) for _ in range(rng.randint(4, 400))], rng.randint(8, 128))
                for _ in range(32)]
    ex = executor(engine, max_batch_size=8, max_num_tokens=128)
    requests = run_checked(ex, arrivals)
    by_prompt = {id(r): r for r in requests}
    assert len(by_prompt) == 32
    for (_, prompt, n), req in zip(sorted(arrivals, key=lambda a: a[0]), requests):
        assert req.prompt == prompt
        assert req.output == alone(engine, prompt, n), f"request with a {len(prompt)}-token prompt differs"
        assert req.finish_reason == "length"
    assert ex.allocator.peak_used <= ex.allocator.num_blocks


def shared_prefix_workload(rng: random.Random, system: list[int], count: int) -> list[tuple[int, list[int], int]]:
    return [(3 * i, system + [rng.randrange(96) for _ in range(rng.randint(1, 40))], rng.randint(4, 24))
            for i in range(count)]


def test_shared_system_prompt_is_reused_and_outputs_unchanged(engine):
    rng = random.Random(1)
    system = [rng.randrange(96) for _ in range(70)]  # 4 full blocks of 16, then 6 tokens
    arrivals = shared_prefix_workload(rng, system, 8)
    plain = [r.output for r in run_checked(executor(engine, reuse=False, max_batch_size=4), arrivals)]
    ex = executor(engine, reuse=True, max_batch_size=4)
    reused = [r.output for r in run_checked(ex, arrivals)]
    assert reused == plain
    stats = ex.allocator.stats
    # The first request computes the 4 system blocks; the others (arriving later) reuse them.
    assert stats.hit_blocks >= 4 * (len(arrivals) - 2), stats
    assert stats.hit_tokens == stats.hit_blocks * BLOCK
    assert 0 < stats.hit_rate <= 1


def test_whole_prompt_cached_still_computes_its_last_token(engine):
    """A prompt made only of cached full blocks must still run its last token (its logits pick
    the first output), so a repeated request gives the same tokens."""
    prompt = list(range(1, 1 + 3 * BLOCK))
    ex = executor(engine, reuse=True)
    first = run_checked(ex, [(0, prompt, 10)])[0].output
    again = run_checked(ex, [(0, prompt, 10)])[0].output
    assert again == first == alone(engine, prompt, 10)
    assert ex.allocator.stats.hit_blocks == 2  # blocks 0 and 1; block 2 holds the last prompt token


def test_eviction_when_the_pool_is_short(engine):
    """A pool of 12 blocks and many distinct prompts: cached blocks are evicted (LRU) to make
    room, nothing leaks, outputs are those of a run without reuse."""
    rng = random.Random(2)
    arrivals = [(i, [rng.randrange(96) for _ in range(rng.randint(20, 60))], 8) for i in range(10)]
    ex = executor(engine, reuse=True, max_batch_size=2, max_tokens_in_paged_kv_cache=12 * BLOCK)
    outputs = [r.output for r in run_checked(ex, arrivals)]
    assert ex.allocator.stats.evictions > 0
    assert ex.allocator.peak_used <= 12
    assert outputs == [alone(engine, p, n) for _, p, n in arrivals]


def test_cancel_mid_prefill_and_mid_decode_returns_blocks(engine):
    ex = executor(engine, reuse=True, max_num_tokens=32)
    long = ex.add(list(range(90)), SamplingConfig(max_new_tokens=20, **GREEDY))
    short = ex.add([5, 6, 7], SamplingConfig(max_new_tokens=50, **GREEDY))
    ex.step()
    ex.cancel(long)  # mid prefill: 32 of 90 prompt tokens cached
    for _ in range(5):
        ex.step()
    ex.cancel(short)  # mid decode
    assert not ex.has_work
    assert long.finish_reason == short.finish_reason == "cancelled"
    ex.allocator.check_whole()


def test_reuse_is_off_for_prefix_lm_and_2d_positions():
    """ChatGLM v1's K/V depend on the whole prompt (bidirectional prefix, 2D positions): no reuse."""
    from bestiary.core.runtime.model import DecoderLM

    class PrefixLM(DecoderLM):
        mask_kind = "prefix_lm"

    class Positions2D(DecoderLM):
        def position_ids(self, tokens, start, count):  # pragma: no cover - never called
            raise NotImplementedError

    assert supports_block_reuse(DecoderLM.__new__(DecoderLM))
    assert not supports_block_reuse(PrefixLM.__new__(PrefixLM))
    assert not supports_block_reuse(Positions2D.__new__(Positions2D))


def test_memory_fraction_caps_the_pool(engine):
    build = finalize_build_config(BuildConfig(tokens_per_block=BLOCK, max_seq_len=600), engine.config.model_dump())
    full = Executor(engine.model, build)
    capped = Executor(engine.model, build, kv_cache_config=KvCacheConfig(max_tokens=64))
    assert capped.allocator.num_blocks == 4 < full.allocator.num_blocks
    with pytest.raises(Exception, match="does not fit the KV cache"):
        capped.add(list(range(60)), SamplingConfig(max_new_tokens=20, **GREEDY))
