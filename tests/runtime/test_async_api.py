"""The asyncio API: concurrent `generate_async` calls share one in-flight batch."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine  # noqa: E402
from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(10, 40)), [42]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    base = tmp_path_factory.mktemp("async")
    convert(make_tiny_llama(base), base / "ckpt", show_progress=False)
    build_engine(base / "ckpt", base / "engine", BuildConfig(max_batch_size=4, tokens_per_block=8))
    model = LLM(base / "engine")
    yield model
    model.close()


async def collect(llm, prompt, n):
    ids, reasons = [], []
    async for delta in llm.generate_async(prompt, SamplingConfig(max_new_tokens=n, **GREEDY)):
        ids += delta.token_ids
        reasons.append(delta.finish_reason)
    return ids, reasons


def test_concurrent_requests_equal_the_sync_api(llm):
    sync = [c.output_ids for c in llm.generate(PROMPTS, SamplingConfig(max_new_tokens=12, **GREEDY))]

    async def main():
        return await asyncio.gather(*(collect(llm, p, 12) for p in PROMPTS))

    results = asyncio.run(main())
    assert [ids for ids, _ in results] == sync
    for _, reasons in results:
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    llm.executor.allocator.check_whole()


def test_abandoned_stream_cancels_its_request(llm):
    """Leaving the async for early cancels the request: its blocks come back, the others finish."""

    async def main():
        async def first_two(prompt):
            got = []
            async for delta in llm.generate_async(prompt, SamplingConfig(max_new_tokens=50, **GREEDY)):
                got += delta.token_ids
                if len(got) >= 2:
                    break
            return got

        partial, (full, _) = await asyncio.gather(first_two(PROMPTS[0]), collect(llm, PROMPTS[1], 20))
        await asyncio.sleep(0)
        return partial, full

    partial, full = asyncio.run(main())
    assert len(partial) >= 2 and len(full) == 20
    # Straight after: the sync API works (the queued cancel is waited for), blocks came back.
    again = llm.generate([PROMPTS[1]], SamplingConfig(max_new_tokens=20, **GREEDY))[0].output_ids
    assert again == full
    assert not llm.executor.has_work
    llm.executor.allocator.check_whole()


def test_limit_errors_raise_before_the_first_delta(llm):
    async def main():
        async for _ in llm.generate_async(list(range(5000)), SamplingConfig(max_new_tokens=4)):
            pass

    with pytest.raises(Exception, match="max_input_len"):
        asyncio.run(main())
