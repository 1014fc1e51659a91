"""LoRA with tensor and pipeline parallelism: TensorRT-LLM's split (column-parallel: B's rows,
row-parallel: A's columns) on each rank's shard, and tp 2, pp 2 and tp 2 x pp 2 (gloo worker
groups) equal to tp 1 for mixed batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lora_helpers import peft_adapter  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert, instantiate  # noqa: E402
from bestiary.core.format.config import read_json  # noqa: E402
from bestiary.core.lora.adapter import load_adapter, place, read_peft  # noqa: E402
from bestiary.core.lora.request import LoraRequest  # noqa: E402
from bestiary.core.runtime.engine import Engine, validate_model_config  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.core.runtime.step_broadcast import check_mirror  # noqa: E402
from bestiary.registry import default_registry  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 60, 3, 42], [8, 61, 27, 9], [11, 70, 7, 33, 2, 90, 14], [4, 4, 9]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp")
    source = make_tiny_llama(root / "llama")
    for name, tp, pp in (("tp1", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2), ("tp2pp2", 2, 2)):
        convert(source, root / name, ConvertOptions(tp_size=tp, pp_size=pp, dtype="float32"), show_progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    peft_adapter(hf, root / "all8", seed=8, b_scale=2.0, r=8, lora_alpha=16, target_modules=TARGETS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    peft_adapter(hf, root / "ov4", seed=4, b_scale=2.0, r=4, lora_alpha=4, target_modules=["o_proj", "down_proj", "k_proj"])
    return root


def _rank_model(directory, rank: int):
    data = read_json(directory / "config.json")
    registry = default_registry()
    config = validate_model_config(data, str(directory / "config.json"), registry)
    with torch.device("meta"):
        return instantiate(registry.get(config.architecture), config, rank)


def test_column_parallel_splits_b_row_parallel_splits_a(setup):
    """TensorRT-LLM's rule on a tp 2 shard: qkv / fc / gate keep A whole and their rows of B (kv rows as the
    weight's), dense / proj keep B whole and their columns of A; the shards rebuild tp 1's update."""
    root = setup
    full = load_adapter(root / "all8", Engine.load(root / "tp1").model)
    source = read_peft(root / "all8", default_registry().get("LlamaForCausalLM"))
    ranks = [place(source, _rank_model(root / "tp2", r)) for r in range(2)]
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))  # wide enough for K = 64 and 80
    for path in ("mlp.fc", "mlp.gate", "mlp.proj", "attention.dense"):
        key = (f"transformer.layers.1.{path}", -1)
        (f,), parts = full.pieces[key], [r.pieces[key][0] for r in ranks]
        if path in ("mlp.fc", "mlp.gate"):  # column-parallel
            assert all(torch.equal(p.a, f.a) for p in parts)
            assert torch.equal(torch.cat([p.b for p in parts]), f.b)
        else:  # row-parallel
            assert all(torch.equal(p.b, f.b) for p in parts)
            assert torch.equal(torch.cat([p.a for p in parts], dim=1), f.a)
            k = f.a.shape[1] // 2
            summed = sum(p.b @ (p.a @ x[:, r * k : (r + 1) * k].T) for r, p in enumerate(parts))
            torch.testing.assert_close(summed, f.b @ (f.a @ x[:, : f.a.shape[1]].T))
    # q / k / v: rank r keeps its heads' rows of the fused [q; k; v] (4 heads, 2 kv heads of 16)
    key = ("transformer.layers.0.attention.qkv", -1)
    for module, rows in (("attn_q", [slice(0, 32), slice(32, 64)]), ("attn_k", [slice(64, 80), slice(80, 96)])):
        f = next(p for p in full.pieces[key] if p.module == module)
        for r, rank in enumerate(ranks):
            p = next(p for p in rank.pieces[key] if p.module == module)
            assert torch.equal(p.a, f.a)
            local = {"attn_q": slice(0, 32), "attn_k": slice(32, 48)}[module]  # rank rows: [q 32; k 16; v 16]
            assert torch.equal(p.b[local], f.b[rows[r]]) and p.b.shape[0] == 64


@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2pp2"])
def test_parallel_equals_tp1_with_mixed_adapters(setup, layout, monkeypatch):
    """PEFT adapters, TensorRT-LLM LoRA tensors and base requests in one batch: tp 2's, pp 2's and tp 2 x pp 2's
    context logits within 1e-5 of tp 1's and the same greedy tokens; every rank ran every step. On
    pipeline stages the batch is cut into 2 micro-batches, each with its own sequences' adapters."""
    monkeypatch.setenv("BESTIARY_PP_MICRO_BATCHES", "2")  # read by the driver (this process) each step
    root = setup
    tp1, tp2 = LLM(root / "tp1"), LLM(root / layout, num_threads=1)
    seed_lora = _seed_request(root)
    lora = [LoraRequest("all8", root / "all8"), None, LoraRequest("ov4", root / "ov4"), seed_lora]
    sampling = SamplingConfig(temperature=0, max_new_tokens=8, ignore_eos=True, output_context_logits=True)
    want, got = tp1.generate(PROMPTS, sampling, lora=lora), tp2.generate(PROMPTS, sampling, lora=lora)
    for w, g in zip(want, got):
        torch.testing.assert_close(g.context_logits, w.context_logits, rtol=0, atol=1e-5)
        assert g.output_ids == w.output_ids
    base = tp1.generate(PROMPTS, sampling)
    assert all((w.context_logits - b.context_logits).abs().max() > 1e-2 for w, b, a in zip(want, base, lora) if a)
    # later requests by id alone reuse what the ranks hold
    again = tp2.generate(PROMPTS[:1], sampling, lora=LoraRequest("all8"))
    assert again[0].output_ids == want[0].output_ids
    check_mirror(tp2.engine)
    assert not tp2.lora_store.held


def _seed_request(root) -> LoraRequest:
    from bestiary.core.lora.trtllm_convert import peft_to_trtllm

    registry = default_registry()
    weights, config = peft_to_trtllm(root / "ov4", registry.get("LlamaForCausalLM"), registry, torch.float32)
    return LoraRequest("seed-ov4", weights=weights.numpy(), config=np.asarray(config))
