"""Embeddings (core.runtime.pooling, Executor(pooling=...), LLM.embed / embed_async) against transformers:
the final-norm hidden states (`last_hidden_state`) pooled by the last token or the mean, L2-normalised;
batched with generating requests, across prefill chunks, cancelled without holding a block."""

from __future__ import annotations

import asyncio

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine  # noqa: E402
from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 54, 7, 90, 26, 38, 65, 11, 80, 4], [42], [8, 9, 10, 11, 12, 13, 14]]


def reference(hf_model, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """transformers: last_hidden_state [T, H] pooled, normalised."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, H]
    e = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(e, dim=0) if normalize else e


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(hf model, LLM on its fp32 engine with 8-token prefill chunks: a 20-token prompt takes 3 steps)."""
    root = tmp_path_factory.mktemp("embeddings")
    hf_dir = make_tiny_llama(root)
    ckpt = convert(hf_dir, root / "ckpt", show_progress=False)
    engine = build_engine(ckpt, root / "engine", BuildConfig(max_batch_size=4, max_seq_len=64, max_num_tokens=8,
                                                             tokens_per_block=4))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    return hf, LLM(engine)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooled_hidden_states(tiny, pooling):
    hf, llm = tiny
    ours = llm.embed(PROMPTS, pooling=pooling)  # [3, H]
    expected = torch.stack([reference(hf, p, pooling) for p in PROMPTS])
    assert ours.shape == expected.shape and ours.dtype == torch.float32
    assert (ours - expected).abs().max().item() <= 1e-5
    assert torch.allclose(ours.norm(dim=1), torch.ones(3))
    raw = llm.embed(PROMPTS[0], pooling=pooling, normalize=False)[0]
    assert (raw - reference(hf, PROMPTS[0], pooling, normalize=False)).abs().max().item() <= 1e-4
    assert llm.executor.allocator.num_used == 0


def test_the_two_poolings_differ_and_the_default_is_the_models(tiny):
    """The test above exercises each pooling: they give different vectors; LLM's default is `last`."""
    _, llm = tiny
    last, mean = llm.embed(PROMPTS[0], pooling="last"), llm.embed(PROMPTS[0], pooling="mean")
    assert (last - mean).abs().max().item() > 1e-2
    assert torch.equal(llm.embed(PROMPTS[0]), last) and llm.engine.model.default_pooling == "last"


def test_embedding_requests_batch_with_generation_and_change_nothing_of_it(tiny):
    """Embedding requests share steps with a generating one (async API): its tokens equal a run alone."""
    hf, llm = tiny
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], greedy)[0].output_ids

    async def both():
        async def generate():
            return [t async for d in llm.generate_async(PROMPTS[0], greedy) for t in d.token_ids]

        return await asyncio.gather(generate(), *(llm.embed_async(p, "mean") for p in PROMPTS))

    tokens, *vectors = asyncio.run(both())
    assert tokens == alone
    for p, v in zip(PROMPTS, vectors):
        assert (v - reference(hf, p, "mean")).abs().max().item() <= 1e-5


def test_a_cancelled_embedding_holds_no_block(tiny):
    _, llm = tiny

    async def cancel_one():
        task = asyncio.ensure_future(llm.embed_async(PROMPTS[0], "mean"))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.2)  # the drop runs on the worker's next turn

    asyncio.run(cancel_one())
    llm._check_sync_allowed()
    assert llm.executor.allocator.num_used == 0 and not llm.executor.running and not llm.executor.waiting


def test_a_bad_pooling_or_input_is_a_one_line_error(tiny):
    _, llm = tiny
    with pytest.raises(BestiaryError, match="pooling 'max': expected one of last, mean"):
        llm.embed(PROMPTS[0], pooling="max")  # type: ignore[arg-type]
    with pytest.raises(BestiaryError, match="outside the vocabulary"):
        llm.embed([[5, 1000]])
    assert llm.executor.allocator.num_used == 0 and not llm.executor.waiting


@pytest.mark.slow
def test_smollm2_embeddings_equal_transformers(smollm2_fp32_engine, hf_model, hf_tokenizer):
    """SmolLM2-135M-Instruct (the GGUF, dequantised to fp32 on both sides): within 1e-4, both poolings."""
    llm = LLM(smollm2_fp32_engine)
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Hi"]
    ids = [hf_tokenizer(t).input_ids for t in texts]
    for pooling in ("last", "mean"):
        ours = llm.embed(ids, pooling=pooling)
        expected = torch.stack([reference(hf_model, p, pooling) for p in ids])
        assert (ours - expected).abs().max().item() <= 1e-4, pooling
