"""CUDA: engines on a GPU (`device="cuda"`), tp 2 over nccl. Skipped without CUDA; `make test-gpu`
runs this suite (marker `gpu`) whenever a machine has one (two GPUs for the tp 2 test)."""

from __future__ import annotations

import parity
import pytest
import torch
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PROMPT = [3, 17, 45, 8, 60, 22, 31, 9]
GREEDY = SamplingConfig(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    src = make_tiny_llama(root, num_key_value_heads=1)
    return convert(src, root / "tp1", show_progress=False), convert(src, root / "tp2", ConvertOptions(tp_size=2),
                                                                    show_progress=False)


def test_cuda_engine_matches_cpu(ckpts):
    cpu, gpu = Engine.load(ckpts[0]), Engine.load(ckpts[0], device="cuda")
    assert next(gpu.model.parameters()).device.type == "cuda"
    worst, scale = parity.reference_diffs(gpu, lambda ids: parity.EngineRunner(cpu).feed(ids, all_logits=True),
                                          PROMPT, steps=8)
    assert worst <= 1e-3 * max(1.0, scale)


def test_llm_on_cuda_generates_cpu_greedy_text(ckpts):
    expected = LLM(ckpts[0]).generate([PROMPT], GREEDY)[0].output_ids
    llm = LLM(ckpts[0], device="cuda:0")
    assert llm.executor.kv.k.device.type == "cuda"
    assert llm.generate([PROMPT], GREEDY)[0].output_ids == expected


def test_sampling_on_cuda_is_seeded_like_the_cpu(ckpts):
    """Sampled requests on a CUDA engine draw with the request's CPU generator (a CUDA
    multinomial would refuse it): a seed gives the same tokens on both devices, and the
    speculative acceptance rule samples there too."""
    sampled = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=12, ignore_eos=True, random_seed=7)
    expected = LLM(ckpts[0]).generate([PROMPT], sampled)[0].output_ids
    assert LLM(ckpts[0], device="cuda").generate([PROMPT], sampled)[0].output_ids == expected
    spec = LLM(ckpts[0], device="cuda", speculative={"method": "ngram", "num_draft_tokens": 3})
    assert len(spec.generate([PROMPT * 3], sampled)[0].output_ids) == 12


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp 2 on nccl needs two GPUs")
def test_tp2_on_two_gpus_over_nccl(ckpts):
    expected = LLM(ckpts[0]).generate([PROMPT], GREEDY)[0].output_ids
    llm = LLM(ckpts[1], device="cuda")
    try:
        assert torch.distributed.get_backend() == "nccl"
        assert llm.generate([PROMPT], GREEDY)[0].output_ids == expected
    finally:
        llm.close()
