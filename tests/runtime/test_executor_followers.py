"""Followers (`Executor.add(after=...)`): requests whose prompts extend a queued request's fork its computed
prompt (full blocks shared, the partial last block copied) and compute only the rest: the same tokens and
context logits as each alone, the shared prompt computed once, the KV pool whole afterwards."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.format.build_config import BuildConfig, finalize_build_config  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.executor import Executor  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

GREEDY = SamplingConfig(max_new_tokens=3, temperature=0.0, ignore_eos=True, output_context_logits=True)
LEAD = SamplingConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 3, 44, 9, 61, 2, 8, 30, 11, 7, 19, 23]  # 13 tokens: one full block of 8 and a partial one
SUFFIXES = [[40], [41, 42, 43], [50, 51, 52, 53, 54, 55, 56, 57, 58]]  # the last crosses two block boundaries


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    base = tmp_path_factory.mktemp("followers")
    convert(make_tiny_llama(base, max_position_embeddings=256), base / "ckpt", show_progress=False)
    return Engine.load(base / "ckpt")


def executor(engine, max_batch_size: int = 8) -> Executor:
    build = finalize_build_config(BuildConfig(tokens_per_block=8, max_batch_size=max_batch_size),
                                  engine.config.model_dump())
    return Executor(engine.model, build)


def counting(ex: Executor) -> list[int]:
    """The tokens each step of `ex` computes, recorded as it runs."""
    counts: list[int] = []
    schedule = ex._schedule
    ex._schedule = lambda: (lambda work: counts.append(sum(n for *_, n in work)) or work)(schedule())  # type: ignore[method-assign]
    return counts


def test_followers_equal_each_alone_and_share_the_prompt(engine):
    ex = executor(engine)
    counts = counting(ex)
    leader = ex.add(list(PROMPT), LEAD)
    followers = [ex.add(PROMPT + s, GREEDY, after=leader) for s in SUFFIXES]
    ex.run([leader, *followers])
    # the prompt once, each suffix once, then 2 decode tokens per follower
    assert sum(counts) == len(PROMPT) + sum(len(s) + 2 for s in SUFFIXES)
    ex.allocator.check_whole()
    for suffix, follower in zip(SUFFIXES, followers):
        ref = executor(engine)
        alone = ref.add(PROMPT + suffix, GREEDY, reuse_prefix=False)
        ref.run([alone])
        assert follower.output == alone.output
        ours = torch.cat(follower.context_logits)  # [len(suffix), V]: the rows it computed
        assert torch.allclose(ours, torch.cat(alone.context_logits)[-len(suffix):], atol=1e-5)


def test_cancelled_leader_ends_its_parked_followers(engine):
    ex = executor(engine)
    leader = ex.add(list(PROMPT), LEAD)
    follower = ex.add(PROMPT + [1, 2], GREEDY, after=leader)
    ex.cancel(leader)
    assert leader.finish_reason == follower.finish_reason == "cancelled"
    ex.allocator.check_whole()


def test_follower_mistakes_are_refused(engine):
    ex = executor(engine, max_batch_size=2)
    leader = ex.add(list(PROMPT), LEAD)
    with pytest.raises(BestiaryError, match="must extend that request's prompt of 13 tokens"):
        ex.add([1, 2, 3] + PROMPT, GREEDY, after=leader)
    with pytest.raises(BestiaryError, match="must extend"):
        ex.add(list(PROMPT), GREEDY, after=leader)
    ex.add(PROMPT + [1], GREEDY, after=leader)
    with pytest.raises(BestiaryError, match="max_batch_size 2"):
        ex.add(PROMPT + [2], GREEDY, after=leader)
    ex.step()  # the leader is admitted: no longer queued
    with pytest.raises(BestiaryError, match="no longer queued"):
        ex.add(PROMPT + [3], GREEDY, after=leader)
    ex.run([leader])
    while ex.has_work:
        ex.step()
    ex.allocator.check_whole()
