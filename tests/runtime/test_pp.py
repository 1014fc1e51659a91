"""Pipeline-parallel engines (core.runtime.pipeline): pp 2 and tp 2 x pp 2 equal tp 1.

The tiny fp32 models of test_tp_runtime (the six built-in architectures, quantized and INT8/FP8 KV
variants) converted with --pp_size 2 (one layer per stage; `llama3` has 3 layers: stages of 2 and 1)
or --tp_size 2 --pp_size 2 run on spawned gloo ranks: the prefill and 16 teacher-forced decode
steps are within 1e-5 of tp 1 (the W8A16 / W4A16 relative bounds of test_tp_runtime), greedy
tokens equal tp 1's up to its first near-tie, and `check_mirror` finds every rank ran every step
with the layers and kv heads of its stage and tp rank.
"""

from __future__ import annotations

from pathlib import Path

import parity
import pytest
import test_tp_runtime as tpr
import torch
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.checkpoint import global_layer_key, load_rank_weights
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import BestiaryError
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.pipeline import micro_batches, slice_meta
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.core.runtime.step_broadcast import check_mirror

transformers = pytest.importorskip("transformers")

BUILT_INS = ("llama", "mixtral", "opt", "falcon", "glm", "chatglm_v1")
VARIANTS = {
    **tpr.VARIANTS,
    "llama3": ("llama3", {}),
    "llama_gptq": ("llama_i128", {"quantization": QuantConfig(quant_algo="W4A16", group_size=32)}),
}
PP2 = [*BUILT_INS, "llama3", "llama_w8a16", "llama_w4a16", "llama_int8_kv", "llama_fp8_kv", "llama_gptq"]
TP2PP2 = [*BUILT_INS, "llama_int8_kv"]
REL_TOL = {**tpr.REL_TOL, "llama_gptq": 1e-2}


# --- micro-batches and their metadata (no ranks) ------------------------------------------------
@pytest.mark.parametrize("seq_lens,count,expected", [
    ([1] * 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    ([1] * 5, 2, [(0, 3), (3, 5)]),  # 2.5 tokens each: the greedy cut takes 3
    ([1, 1, 1], 8, [(0, 1), (1, 2), (2, 3)]),  # never more ranges than sequences
    ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),  # one long prefill is a micro-batch of its own
    ([1, 1, 1, 100], 2, [(0, 3), (3, 4)]),
    ([7], 4, [(0, 1)]),
    ([5, 5, 5, 5, 5, 5], 3, [(0, 2), (2, 4), (4, 6)]),
])
def test_micro_batches_are_contiguous_and_balanced(seq_lens, count, expected):
    assert micro_batches(seq_lens, count) == expected


def test_micro_batch_count(monkeypatch):
    from bestiary.core.runtime.pipeline import micro_batch_count

    monkeypatch.delenv("BESTIARY_PP_MICRO_BATCHES", raising=False)
    assert micro_batch_count([1] * 16, 2) == 1  # a 16-sequence decode: too few tokens to cut
    assert micro_batch_count([1] * 200, 2) == 3  # 200 tokens: 3 micro-batches of 64+
    assert micro_batch_count([1] * 512, 2) == 4  # at most 2 * pp
    assert micro_batch_count([300, 300], 3) == 2  # at most one per sequence
    assert micro_batch_count([20], 2) == 1
    monkeypatch.setenv("BESTIARY_PP_MICRO_BATCHES", "3")
    assert micro_batch_count([1] * 16, 2) == 3 and micro_batch_count([1, 1], 2) == 2
    monkeypatch.setenv("BESTIARY_PP_MICRO_BATCHES", "0")
    with pytest.raises(BestiaryError, match=r"^BESTIARY_PP_MICRO_BATCHES='0': expected a positive integer$"):
        micro_batch_count([1], 2)


def test_slice_meta_equals_metadata_built_for_the_subset():
    """Sequences [1, 3) of a 4-sequence step: the slice is the metadata built for those two alone, and
    its token range covers their packed ids."""
    seq_lens, ctx = [3, 1, 4, 2], [0, 5, 2, 7]
    tables = [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]
    whole = AttentionMetadata.build(seq_lens, ctx, tables, 4, windows=[0, 3, 5, 0], sinks=[0, 1, 2, 0])
    part, ta, tb = slice_meta(whole, 1, 3)
    alone = AttentionMetadata.build(seq_lens[1:3], ctx[1:3], tables[1:3], 4, windows=[3, 5], sinks=[1, 2])
    assert (ta, tb) == (3, 8)
    for name in ("positions", "slot_mapping", "last_token_index"):
        assert torch.equal(getattr(part, name), getattr(alone, name)), name
    assert torch.equal(part.block_tables[:, :3], alone.block_tables)
    for name in ("seq_lens", "context_lens", "windows", "sinks", "contiguous_from", "block_size"):
        assert getattr(part, name) == getattr(alone, name), name


def test_global_layer_key():
    assert global_layer_key("transformer.layers.0.attention.qkv.weight", 15) == "transformer.layers.15.attention.qkv.weight"
    assert global_layer_key("transformer.layers.11.mlp.fc.weight", 0) == "transformer.layers.11.mlp.fc.weight"
    assert global_layer_key("transformer.ln_f.weight", 7) == "transformer.ln_f.weight"
    assert global_layer_key("lm_head.weight", 7) == "lm_head.weight"


# --- engines on ranks ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp_sources")
    return {**tpr.tiny_sources(root), "llama3": make_tiny_llama(root / "llama3", num_hidden_layers=3)}


@pytest.fixture(scope="module")
def checkpoints(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_ckpts")

    def get(case: str, tp: int, pp: int) -> Path:
        out = root / f"{case}_tp{tp}_pp{pp}"
        if not out.exists():
            source, kwargs = VARIANTS[case]
            convert(sources[source], out, ConvertOptions(tp_size=tp, pp_size=pp, **kwargs), show_progress=False)
        return out

    return get


def check_equals_tp1(case: str, tp: int, pp: int, checkpoints) -> list[dict]:
    """Teacher-forced logits and greedy tokens of the (tp, pp) engine against tp 1; the mirror reports."""
    prompt = tpr.PROMPTS.get(VARIANTS[case][0], tpr.DEFAULT_PROMPT)
    ref, tokens = tpr.teacher_forced(Engine.load(checkpoints(case, 1, 1)), prompt)
    llm = LLM(checkpoints(case, tp, pp), num_threads=1)
    try:
        assert (llm.engine.model.tp_size, llm.engine.model.pp_size) == (tp, pp)
        ours, _ = tpr.teacher_forced(llm.engine, prompt, tokens)
        worst = (ours - ref).abs().max().item()
        tol = REL_TOL[case] * ref.abs().max().item() if case in REL_TOL else tpr.LOGIT_TOL
        assert worst <= tol, f"{case}: max |tp{tp} pp{pp} - tp1| = {worst:.3g}"
        sampling = SamplingConfig(temperature=0, max_new_tokens=tpr.STEPS, ignore_eos=True)
        (out,) = llm.generate([prompt], sampling)
        agree = tpr.first_near_tie(ref, REL_TOL.get(case, tpr.NEAR_TIE))
        assert agree >= tpr.STEPS // 2, f"{case}: tp 1 has a near-tie at step {agree}; pick another prompt"
        assert out.output_ids[:agree] == tokens[:agree]
        return check_mirror(llm.engine)
    finally:
        llm.close()


@pytest.mark.parametrize("case", PP2)
def test_pp2_equals_tp1(case, checkpoints):
    reports = check_equals_tp1(case, 1, 2, checkpoints)
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["pipeline"]["steps"] == reports[0]["steps"] for r in reports)


@pytest.mark.parametrize("case", TP2PP2)
def test_tp2_pp2_equals_tp1(case, checkpoints):
    reports = check_equals_tp1(case, 2, 2, checkpoints)
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]


@pytest.mark.parametrize("case,tp", [("llama", 1), ("llama3", 1), ("llama_w8a16", 1), ("llama", 2), ("llama_int8_kv", 2)])
def test_stage_decode_plans_equal_eager_and_tp1(case, tp, checkpoints):
    """Every stage decodes with its compiled plan (stage 0 from the token ids, the last stage to the
    logits, the hidden state handed over in between): logits within tp 1's bound of tp 1 and of the
    same ranks run eagerly (kernels_mode("torch") on the driver, sent with each step)."""
    from bestiary.core.kernels.dispatch import kernels_mode

    prompt = tpr.PROMPTS.get(VARIANTS[case][0], tpr.DEFAULT_PROMPT)
    ref, tokens = tpr.teacher_forced(Engine.load(checkpoints(case, 1, 1)), prompt)
    tol = REL_TOL[case] * ref.abs().max().item() if case in REL_TOL else tpr.LOGIT_TOL
    llm = LLM(checkpoints(case, tp, 2), num_threads=1)
    try:
        assert llm.engine.model.decode_plan_status() is None
        before = tpr.plan_steps(llm.engine)
        planned, _ = tpr.teacher_forced(llm.engine, prompt, tokens)
        assert [b - a for a, b in zip(before, tpr.plan_steps(llm.engine))] == [tpr.STEPS] * (2 * tp)
        with kernels_mode("torch"):
            eager, _ = tpr.teacher_forced(llm.engine, prompt, tokens)
        assert tpr.plan_steps(llm.engine) == [b + tpr.STEPS for b in before], "the eager run used the plan"
        for name, other in (("tp 1", ref), ("eager", eager)):
            worst = (planned - other).abs().max().item()
            assert worst <= tol, f"{case}: max |plan tp{tp} pp2 - {name}| = {worst:.3g}"
    finally:
        llm.close()


def test_in_flight_batch_is_cut_into_micro_batches(checkpoints):
    """Five requests of 20..100 prompt tokens, submitted together on pp 2: each equals its tp 1 run, the
    prefill steps were cut into several micro-batches, and both stages ran every step."""
    prompts = [[(5 * i + 7 * j) % 90 + 3 for i in range(20 + 20 * j)] for j in range(5)]
    sampling = SamplingConfig(temperature=0, max_new_tokens=6, ignore_eos=True)
    ref = LLM(checkpoints("llama3", 1, 1)).generate(prompts, sampling)
    llm = LLM(checkpoints("llama3", 1, 2), num_threads=1)
    try:
        out = llm.generate(prompts, sampling)
        assert [o.output_ids for o in out] == [r.output_ids for r in ref]
        stats = [r["pipeline"] for r in check_mirror(llm.engine)]
        assert stats[0]["micro_batches"] > stats[0]["steps"]  # 5 sequences: up to 4 micro-batches a step
        assert stats[0]["micro_batches"] == stats[1]["micro_batches"]
        assert 0.0 <= stats[1]["bubble"] < 1.0
    finally:
        llm.close()


@pytest.mark.parametrize("case", ["llama_gptq", "llama_int8_kv"])
def test_calibrated_pipeline_ranks_are_cut_from_the_tp1_checkpoint(case, checkpoints):
    """GPTQ weights and KV scales are calibrated once on the whole model: every tensor of each stage's
    rank file is the tp 1 tensor of its global layer, bit for bit (stage 1 of a 2-layer model holds
    layer 1 as `transformer.layers.0`)."""
    reference = load_rank_weights(checkpoints(case, 1, 1), 0)
    seen = set()
    for rank, offset in ((0, 0), (1, 1)):
        for key, tensor in load_rank_weights(checkpoints(case, 1, 2), rank).items():
            whole = key if not key.startswith("transformer.layers.") else (
                f"transformer.layers.{int(key.split('.')[2]) + offset}.{key.split('.', 3)[3]}")
            assert torch.equal(tensor, reference[whole]), f"rank {rank} {key}"
            seen.add(whole)
    assert seen == set(reference)


def test_pipeline_checkpoint_reassembles_for_gptq_at_tp2_pp2(checkpoints):
    whole = parity.reassemble_checkpoint(checkpoints("llama_gptq", 2, 2))
    reference = load_rank_weights(checkpoints("llama_gptq", 1, 1), 0)
    assert set(whole) == set(reference)
    for key, tensor in reference.items():
        assert torch.equal(whole[key], tensor), key


def test_perplexity_on_pp2_equals_tp1(checkpoints):
    """`bestiary eval`'s scorer runs all_logits steps: every position's logits come back from the last
    stage; the NLL of 120 tokens (prefill chunks cut into micro-batches) is tp 1's within 1e-5."""
    from bestiary.core.runtime.evaluate import perplexity

    ids = [(11 * i + 5) % 90 + 3 for i in range(120)]
    ref = perplexity(Engine.load(checkpoints("llama3", 1, 1)), ids)
    llm = LLM(checkpoints("llama3", 1, 2), num_threads=1)
    try:
        ours = perplexity(llm.engine, ids)
    finally:
        llm.close()
    assert ours.tokens == ref.tokens
    assert abs(ours.nll - ref.nll) <= 1e-5 * max(1.0, abs(ref.nll))
