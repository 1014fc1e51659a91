"""The executor: in-flight batching, chunked prefill, paged KV blocks, sampling, cancel."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.format.build_config import BuildConfig, finalize_build_config  # noqa: E402
from bestiary.core.kernels.sampling_ref import filter_logits
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.executor import Executor  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    base = tmp_path_factory.mktemp("exec")
    convert(make_tiny_llama(base, max_position_embeddings=256), base / "ckpt", show_progress=False)
    return Engine.load(base / "ckpt")


def executor(engine, **limits) -> Executor:
    build = finalize_build_config(BuildConfig(tokens_per_block=8, **limits), engine.config.model_dump())
    return Executor(engine.model, build)


def alone(engine, prompt, n) -> list[int]:
    ex = executor(engine)
    req = ex.add(prompt, SamplingConfig(max_new_tokens=n, **GREEDY))
    ex.run([req])
    return req.output


def staggered(ex: Executor, work: list[tuple[list[int], int]], rng: random.Random) -> list:
    """Run greedy (prompt, new tokens) requests, each added at a random later step (p 0.5 per step)."""
    reqs, pending = [], list(work)
    while pending or ex.has_work:
        if pending and rng.random() < 0.5:
            prompt, n = pending.pop(0)
            reqs.append(ex.add(prompt, SamplingConfig(max_new_tokens=n, **GREEDY)))
        ex.step()
    return reqs


def test_mixed_workload_equals_each_alone(engine):
    """Requests arriving at different steps, chunked prefill, small batch: same greedy tokens as alone."""
    rng = random.Random(0)
    work = [([rng.randrange(96) for _ in range(rng.randint(3, 60))], rng.randint(2, 20)) for _ in range(10)]
    ex = executor(engine, max_batch_size=3, max_num_tokens=24)
    reqs = staggered(ex, work, rng)
    for (prompt, n), req in zip(work, reqs):
        assert req.output == alone(engine, prompt, n)
        assert req.finish_reason == "length"
    ex.allocator.check_whole()


def test_unwritten_kv_slots_never_leak(engine):
    """Pools start as uninitialised memory: NaN in never-written slots must not reach a batched decode."""
    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
    ex = executor(engine, max_batch_size=3)
    ex.kv.k.fill_(float("nan"))
    ex.kv.v.fill_(float("nan"))
    reqs = [ex.add(p, SamplingConfig(max_new_tokens=6, **GREEDY)) for p in prompts]
    ex.run(reqs)
    assert [r.output for r in reqs] == [alone(engine, p, 6) for p in prompts]
    ex.allocator.check_whole()


def test_kv_blocks_in_use_track_tokens(engine):
    ex = executor(engine, max_batch_size=2)
    reqs = [ex.add([1, 2, 3, 4, 5], SamplingConfig(max_new_tokens=12, **GREEDY)) for _ in range(2)]
    while ex.has_work:
        ex.step()
        for r in reqs:
            if not r.finished:
                assert len(r.blocks) == -(-r.num_cached // 8)
    ex.allocator.check_whole()


def test_cancel_returns_blocks(engine):
    ex = executor(engine)
    req = ex.add(list(range(1, 30)), SamplingConfig(max_new_tokens=50, **GREEDY))
    ex.step()
    ex.step()
    assert req.blocks
    ex.cancel(req)
    assert req.finish_reason == "cancelled"
    ex.allocator.check_whole()


def test_stop_token_ends_generation(engine):
    prompt = [5, 6, 7]
    tokens = alone(engine, prompt, 6)
    ex = executor(engine)
    req = ex.add(prompt, SamplingConfig(max_new_tokens=6, temperature=0.0), stop_ids={tokens[2]})
    ex.run([req])
    assert req.output == tokens[:3] and req.finish_reason == "stop"


def test_seeded_sampling_reproducible_and_seed_dependent(engine):
    def sample(seed):
        ex = executor(engine)
        req = ex.add([1, 2, 3], SamplingConfig(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9,
                                               random_seed=seed, ignore_eos=True))
        return ex.run([req])[0].output

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_top_k_top_p_filter():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [True, False, False, True]
    # probs of sorted [3, 2, 1, 0] ~ [.64, .24, .09, .03]: top_p 0.7 keeps the first two
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [True, False, False, True]
    assert not torch.isinf(filter_logits(logits, 0, 1.0)).any()


def test_limits_are_enforced(engine):
    from bestiary.core.format.errors import BestiaryError

    ex = executor(engine, max_input_len=16, max_seq_len=32)
    with pytest.raises(BestiaryError, match="max_input_len 16"):
        ex.add(list(range(20)), SamplingConfig())
    req = ex.add(list(range(10)), SamplingConfig(max_new_tokens=100, **GREEDY))
    ex.run([req])
    assert len(req.tokens) == 32 and req.finish_reason == "length"
