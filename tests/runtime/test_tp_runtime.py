"""Tensor-parallel engines run on torch.distributed (gloo): tp 2 equals tp 1.

Every test of this module drives the same 2-rank worker group (one per world size per
process: core.runtime.worker_group), so ranks are spawned once. For each tiny fp32 model the
tp 2 logits over a prefill and 16 teacher-forced decode steps are within 1e-5 of tp 1's, and
tp 2's greedy text equals tp 1's up to tp 1's first near-tie (where 1e-6 may pick either).
`check_mirror` (every rank ran every step, its pools mirror the driver's) runs after each.
"""

from __future__ import annotations

from pathlib import Path

import parity
import pytest
import torch
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.checkpoint import load_rank_weights
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.core.runtime.step_broadcast import check_mirror

transformers = pytest.importorskip("transformers")

STEPS = 16
LOGIT_TOL = 1e-5
NEAR_TIE = 1e-4  # a tp 1 top-2 margin below this may flip under a 1e-6 difference


def _hf(model, root: Path, name: str) -> Path:
    return parity.save_hf(parity.reinit_(model, seed=3), root, name)


def tiny_sources(root: Path) -> dict[str, Path]:
    """name -> a tiny random source dir of each built-in architecture (fp32)."""
    import test_chatglm as glm

    t = transformers
    return {
        "llama": make_tiny_llama(root / "llama"),
        "llama_kv1": make_tiny_llama(root / "llama_kv1", num_key_value_heads=1),
        "llama_i128": make_tiny_llama(root / "llama_i128", intermediate_size=128),  # int4 groups of 32 per rank
        "mixtral": _hf(t.MixtralForCausalLM(t.MixtralConfig(
            vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128)),
            root, "mixtral"),
        "opt": _hf(t.OPTForCausalLM(t.OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, ffn_dim=48,
                                                num_attention_heads=4, max_position_embeddings=128)), root, "opt"),
        "falcon": _hf(t.FalconForCausalLM(t.FalconConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
            num_kv_heads=2, bias=True, max_position_embeddings=128)), root, "falcon"),
        "glm": parity.save_hf(glm.glm_model(kv_heads=2, seed=0), root, "glm"),
        "chatglm_v1": glm.write_source(root / "chatglm_v1", glm.v1_weights(glm.V1_CONFIG), glm.V1_CONFIG),
    }


PROMPTS = {"chatglm_v1": [3, 17, 45, 8, 60, 22, 31, 69, 70],  # ... [gMASK] bos
           "llama_i128": [56, 30, 82, 39, 44, 40, 79, 32, 21, 49, 46, 63]}  # no 2% near-tie in 16 steps (int4)
DEFAULT_PROMPT = [(7 * i + 3) % 60 + 3 for i in range(12)]
VARIANTS = {  # case -> (source, ConvertOptions fields)
    **{name: (name, {}) for name in ("llama", "llama_kv1", "mixtral", "opt", "falcon", "glm", "chatglm_v1")},
    "llama_w8a16": ("llama", {"quantization": QuantConfig(quant_algo="W8A16")}),
    "llama_int8_kv": ("llama", {"quantization": QuantConfig(kv_cache_quant_algo="INT8")}),
    "llama_fp8_kv": ("llama", {"quantization": QuantConfig(kv_cache_quant_algo="FP8")}),
    "llama_w4a16": ("llama_i128", {"quantization": QuantConfig(quant_algo="W4A16", group_size=32),
                              "weight_quantizer": "rtn"}),
    "llama_vocab_parallel": ("llama", {"use_parallel_embedding": True, "embedding_sharding_dim": 0}),
    "opt_hidden_parallel": ("opt", {"use_parallel_embedding": True, "embedding_sharding_dim": 1}),
}
# W8A16 multiplies in bf16 on the CPU (WeightOnlySlot.compute_dtype): two ranks' bf16 partial sums,
# all-reduced, round differently from one sum. Its checkpoint is checked bit for bit instead
# (test_quantized_tp2_checkpoint_is_tp1_sharded); the bound is relative to max |logit|.
REL_TOL = {"llama_w8a16": 1e-2, "llama_w4a16": 1e-2}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return tiny_sources(tmp_path_factory.mktemp("tp_sources"))


@pytest.fixture(scope="module")
def checkpoints(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_ckpts")

    def get(case: str, tp: int) -> Path:
        out = root / f"{case}_tp{tp}"
        if not out.exists():
            source, kwargs = VARIANTS[case]
            convert(sources[source], out, ConvertOptions(tp_size=tp, **kwargs), show_progress=False)
        return out

    return get


def teacher_forced(engine: Engine, prompt: list[int], tokens: list[int] | None = None):
    """(logits [1 + STEPS, V] of the prefill's last token and each decode step, greedy tokens): decode
    feeds `tokens` when given, else the engine's own argmax."""
    runner = parity.EngineRunner(engine)
    rows = [runner.feed(prompt)[0]]
    chosen = []
    for i in range(STEPS):
        nxt = tokens[i] if tokens is not None else int(rows[-1].argmax())
        chosen.append(nxt)
        rows.append(runner.feed([nxt])[0])
    return torch.stack(rows), chosen


def first_near_tie(logits: torch.Tensor, rel: float = NEAR_TIE) -> int:
    """Index of the first row whose top-2 margin is below rel * max|row| (len when none)."""
    for i, row in enumerate(logits):
        top = row.topk(2).values
        if (top[0] - top[1]).item() < 2 * rel * row.abs().max().item():
            return i
    return len(logits)


@pytest.mark.parametrize("case", list(VARIANTS))
def test_tp2_equals_tp1(case, checkpoints):
    prompt = PROMPTS.get(VARIANTS[case][0], DEFAULT_PROMPT)
    tp1 = Engine.load(checkpoints(case, 1))
    ref, tokens = teacher_forced(tp1, prompt)
    llm = LLM(checkpoints(case, 2), num_threads=1)
    try:
        ours, _ = teacher_forced(llm.engine, prompt, tokens)
        worst = (ours - ref).abs().max().item()
        tol = REL_TOL[case] * ref.abs().max().item() if case in REL_TOL else LOGIT_TOL
        assert worst <= tol, f"{case}: max |tp2 - tp1| = {worst:.3g}"
        sampling = SamplingConfig(temperature=0, max_new_tokens=STEPS, ignore_eos=True)
        (out,) = llm.generate([prompt], sampling)
        agree = first_near_tie(ref, REL_TOL.get(case, NEAR_TIE))
        assert agree >= STEPS // 2, f"{case}: tp 1 has a near-tie at step {agree}; pick another prompt"
        assert out.output_ids[:agree] == tokens[:agree]
        reports = check_mirror(llm.engine)
        assert [r["rank"] for r in reports] == [0, 1]
    finally:
        llm.close()


def plan_steps(engine) -> list[int]:
    """Decode steps each rank (driver first) ran as one compiled plan (core.runtime.cpu_plan)."""
    return [r["plan_steps"] for r in check_mirror(engine)]


@pytest.mark.parametrize("case", ["llama", "llama_kv1", "llama_w8a16", "llama_int8_kv"])
def test_tp2_decode_plan_equals_eager_and_tp1(case, checkpoints):
    """Every rank decodes with its compiled plan (local heads, all-reduce after each row-parallel
    linear, gathered logits): tp 2 plan logits within 1e-5 of tp 1 (W8A16: its relative bound) and
    of the same ranks run eagerly (kernels_mode("torch") on the driver, sent with each step)."""
    from bestiary.core.kernels.dispatch import kernels_mode

    prompt = PROMPTS.get(VARIANTS[case][0], DEFAULT_PROMPT)
    ref, tokens = teacher_forced(Engine.load(checkpoints(case, 1)), prompt)
    tol = REL_TOL[case] * ref.abs().max().item() if case in REL_TOL else LOGIT_TOL
    llm = LLM(checkpoints(case, 2), num_threads=1)
    try:
        assert llm.engine.model.decode_plan_status() is None
        before = plan_steps(llm.engine)
        planned, _ = teacher_forced(llm.engine, prompt, tokens)
        ran = [b - a for a, b in zip(before, plan_steps(llm.engine))]
        assert ran == [STEPS, STEPS], f"{case}: plan steps per rank {ran}"
        with kernels_mode("torch"):
            eager, _ = teacher_forced(llm.engine, prompt, tokens)
        assert plan_steps(llm.engine) == [b + STEPS for b in before], "the eager run used the plan"
        for name, other in (("tp 1", ref), ("eager tp 2", eager)):
            worst = (planned - other).abs().max().item()
            assert worst <= tol, f"{case}: max |plan tp2 - {name}| = {worst:.3g}"
        agree = first_near_tie(ref, REL_TOL.get(case, NEAR_TIE))
        assert [int(r.argmax()) for r in planned[:agree]] == [int(r.argmax()) for r in ref[:agree]]
    finally:
        llm.close()


def test_decode_plan_refuses_parallel_embedding(checkpoints):
    llm = LLM(checkpoints("llama_vocab_parallel", 2), num_threads=1)
    try:
        assert llm.engine.model.decode_plan_status() == "parallel embedding (use_parallel_embedding) at tp > 1"
    finally:
        llm.close()


@pytest.mark.parametrize("case", ["llama_w8a16", "llama_w4a16", "llama_int8_kv", "llama_fp8_kv"])
def test_quantized_tp2_checkpoint_is_tp1_sharded(case, checkpoints):
    """Every tensor of the tp 2 rank files re-assembles to the tp 1 one bit for bit (int8 per-channel
    scales of row-parallel layers come from the whole rows and are the same on both ranks)."""
    whole = parity.reassemble_checkpoint(checkpoints(case, 2))
    reference = load_rank_weights(checkpoints(case, 1), 0)
    assert set(whole) == set(reference)
    for key, tensor in reference.items():
        assert torch.equal(whole[key], tensor), key


def test_beam_search_and_samples_mirror_kv_copies(checkpoints):
    """n > 1 and beams fork KV blocks on the driver: the copies replay on rank 1, so every beam and
    sample equals tp 1's (beam scores within 1e-4)."""
    configs = [SamplingConfig(temperature=0, max_new_tokens=8, ignore_eos=True, beam_width=3),
               SamplingConfig(temperature=0.8, top_k=5, random_seed=7, n=3, max_new_tokens=8, ignore_eos=True)]
    tp1, tp2 = LLM(checkpoints("llama", 1)), LLM(checkpoints("llama", 2), num_threads=1)
    try:
        for sampling in configs:
            (a,), (b,) = tp1.generate([DEFAULT_PROMPT], sampling), tp2.generate([DEFAULT_PROMPT], sampling)
            assert [x.output_ids for x in a.beams] == [x.output_ids for x in b.beams]
            assert [x.score for x in a.beams] == pytest.approx([x.score for x in b.beams], abs=1e-4)
            assert [x.output_ids for x in a.samples] == [x.output_ids for x in b.samples]
            assert len(b.beams) == 3 or len(b.samples) == 3
        check_mirror(tp2.engine)
    finally:
        tp2.close()


def test_parallel_embedding_holds_a_shard(checkpoints):
    """use_parallel_embedding: each rank file holds 1/tp of the embedding (vocab or hidden dim)."""
    for case, dim in (("llama_vocab_parallel", 0), ("opt_hidden_parallel", 1)):
        full = load_rank_weights(checkpoints(case, 1), 0)["transformer.vocab_embedding.weight"]
        shards = [load_rank_weights(checkpoints(case, 2), r)["transformer.vocab_embedding.weight"] for r in (0, 1)]
        assert torch.equal(torch.cat(shards, dim=dim), full), case


def test_bad_device_is_one_line(checkpoints):
    with pytest.raises(BestiaryError, match=r"--device 'tpu': expected cpu, cuda or cuda:N"):
        LLM(checkpoints("llama", 1), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(BestiaryError, match=r"--device cuda:3: this machine has 0 CUDA device\(s\)"):
            LLM(checkpoints("llama", 1), device="cuda:3")
