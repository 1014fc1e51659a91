"""Qwen3 (dense) against transformers' Qwen3ForCausalLM: the conformance kit over prefill + 16 decode steps,
the per-head QK RMSNorm shown to matter (switched off in transformers and in bestiary, the logits miss), the
head_dim default, and a tp 2 engine equal to tp 1.

Tiny random fp32 models from transformers' own Qwen3Config; weights re-drawn by parity.reinit_
(matrices N(0, 1/fan_in), norms N(1, 0.1)), so the q/k norms are not the identity.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bestiary.testing import conformance  # noqa: E402
from bestiary.testing.parity import assert_split_matches  # noqa: E402

STEPS = 16
TINY = dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128)
# head_dim 32 != hidden / heads (16), as Qwen3's own configs (0.6B: 1024 / 16 heads, head_dim 128).
# gqa_window: use_sliding_window with max_window_layers 1, so (transformers' rule) layer 1 attends through
# window 8 < the 12-token prompt.
QWEN3 = {"gqa_head_dim": TINY | dict(num_key_value_heads=2, head_dim=32),
         "mha_tied": TINY | dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
         "gqa_window": TINY | dict(num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=8,
                                   max_window_layers=1)}
TestQwen3 = conformance("Qwen3ForCausalLM", QWEN3, steps=STEPS)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """(reference, engine) of the gqa_head_dim case, converted at tp 1."""
    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.references import as_reference

    root = tmp_path_factory.mktemp("qwen3")
    reference = as_reference(QWEN3["gqa_head_dim"])
    source = reference.save(root / "source")
    return reference, source, Engine.load(convert(source, root / "tp1", show_progress=False))


def test_qk_norm_is_exercised(gqa):
    """Without the q/k head norms, transformers' logits move by > 100x the parity bound, and so do ours
    (the parity test would catch a family that left QK-norm out)."""
    import torch

    from bestiary.core.layers.self_attention import SelfAttention
    from bestiary.testing.parity import hf_logits, reference_diffs
    from bestiary.testing.suite import PROMPT

    reference, _, engine = gqa
    with_norm = hf_logits(reference.model, PROMPT)
    bound = 1e-4 * max(1.0, with_norm.abs().max().item())
    layers = reference.model.model.layers
    saved = [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in layers]
    try:
        for layer in layers:
            layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
        assert (hf_logits(reference.model, PROMPT) - with_norm).abs().max().item() > 100 * bound
    finally:
        for layer, (q, k) in zip(layers, saved, strict=True):
            layer.self_attn.q_norm, layer.self_attn.k_norm = q, k
    attns = [m for m in engine.model.modules() if isinstance(m, SelfAttention)]
    norms = [(a.q_norm, a.k_norm) for a in attns]
    try:
        for a in attns:
            a.q_norm = a.k_norm = None
        assert reference_diffs(engine, reference.logits, PROMPT, 1)[0] > 100 * bound
    finally:
        for a, (q, k) in zip(attns, norms, strict=True):
            a.q_norm, a.k_norm = q, k


def test_head_dim_default_follows_transformers():
    """A config.json without head_dim: transformers' Qwen3Config uses 128 (not hidden / heads), so does bestiary."""
    import transformers

    from bestiary.core.format.config import Mapping
    from bestiary.models.qwen3.model import from_hf_config

    fields = {k: v for k, v in TINY.items() if k != "model_type"} | dict(num_key_value_heads=2)
    hf = transformers.AutoConfig.for_model("qwen3", **fields)
    config = from_hf_config(fields | {"model_type": "qwen3"}, "float32", Mapping())
    assert config.head_size == hf.head_dim == 128


def test_attention_bias_sets_qkv_and_o():
    """HF attention_bias puts a bias on q, k, v and o (Qwen3Attention); false (every published Qwen3) on none."""
    from bestiary.core.format.config import Mapping
    from bestiary.models.qwen3.model import from_hf_config

    fields = dict(TINY, head_dim=16)
    assert (from_hf_config(fields, "float32", Mapping()).qkv_bias,
            from_hf_config(fields, "float32", Mapping()).dense_bias) == (False, False)
    biased = from_hf_config(fields | {"attention_bias": True}, "float32", Mapping())
    assert (biased.qkv_bias, biased.dense_bias) == (True, True)


def test_tp2_engine_equals_tp1(gqa, tmp_path):
    """A tp 2 engine (two worker ranks) matches transformers over prefill + 16 decode steps within the kit's
    bound and generates tp 1's greedy tokens."""
    reference, source, engine = gqa
    assert_split_matches(reference, source, engine, tmp_path / "tp2", STEPS, tp_size=2)


@pytest.mark.parametrize("module,case", [("test_qwen3", "gqa_window"), ("test_qwen3_moe", "window_tied")])
def test_window_layers_follow_hf_and_matter(module, case, tmp_path):
    """The engine windows exactly the layers transformers windows (Qwen3: i >= max_window_layers; Qwen3-MoE: every
    layer), matches it within the kit's bound, and misses by 100x with no window or a window on every layer."""
    import importlib

    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.parity import reference_diffs
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT

    cases = {"test_qwen3": QWEN3, "test_qwen3_moe": getattr(importlib.import_module(module), "QWEN3_MOE", None)}
    reference = as_reference(cases[module][case])
    engine = Engine.load(convert(reference.save(tmp_path / "src"), tmp_path / "ckpt", show_progress=False))
    hf = reference.model.config
    window = hf.sliding_window
    types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers  # Qwen3-MoE: all
    expected = [window if t == "sliding_attention" else 0 for t in types]
    assert engine.model.attention_windows == expected and window < len(PROMPT)
    diff, scale = reference_diffs(engine, reference.logits, PROMPT, 4)
    bound = 1e-4 * max(1.0, scale)
    assert diff <= bound, f"max|ours - HF| {diff:.3e} > {bound:.3e}"
    attns = [m for m in engine.model.modules() if hasattr(m, "window")]
    for wrong in ([0] * len(attns), [window] * len(attns)):  # no window at all; the window on every layer
        if wrong == expected:
            continue
        for attn, w in zip(attns, wrong, strict=True):
            attn.window = w
        miss = reference_diffs(engine, reference.logits, PROMPT, 1)[0]
        assert miss > 100 * bound, f"windows {wrong}: {miss:.3e} went unnoticed"


# Weight-only int8 / int4 (round to nearest, groups of 32) on the tiny random models: max |quantized - HF| as a
# fraction of max |HF|. Not parity: a sanity bound (Qwen2's built-in measures 2.2% / 47% on the same shapes).
QUANT_BOUNDS = {"W8A16": 0.1, "W4A16": 0.6}


@pytest.mark.parametrize("algo", sorted(QUANT_BOUNDS))
@pytest.mark.parametrize("module,case", [("test_qwen3", "gqa_head_dim"), ("test_qwen3_moe", "norm_topk_prob")])
def test_weight_only_quantized_engines_build_and_run(module, case, algo, tmp_path):
    """W8A16 / W4A16: convert, `build` an engine, load it and generate; its logits stay finite, differ from the
    float ones, within QUANT_BOUNDS of the logit range, and point the same way (cosine > 0.9 per position)."""
    import importlib

    import torch

    from bestiary.core.convert.checkpoint_to_engine import build_engine
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.format.build_config import BuildConfig
    from bestiary.core.format.config import QuantConfig
    from bestiary.core.runtime.engine import Engine
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig
    from bestiary.testing.parity import EngineRunner
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT

    cases = QWEN3 if module == "test_qwen3" else importlib.import_module(module).QWEN3_MOE
    reference = as_reference(cases[case])
    options = ConvertOptions(quantization=QuantConfig(quant_algo=algo, group_size=32), weight_quantizer="rtn")
    ckpt = convert(reference.save(tmp_path / "src"), tmp_path / "ckpt", options, show_progress=False)
    engine_dir = build_engine(ckpt, tmp_path / "engine", BuildConfig(max_seq_len=128, max_batch_size=2))
    engine = Engine.load(engine_dir)
    assert engine.config.quantization.quant_algo == algo
    ours, ref = EngineRunner(engine).feed(PROMPT, all_logits=True), reference.logits(PROMPT)  # [T, V] each
    diff = (ours - ref).abs().max().item() / ref.abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min().item()
    assert torch.isfinite(ours).all() and 0 < diff <= QUANT_BOUNDS[algo] and cosine > 0.9, (diff, cosine)
    (out,) = LLM(engine_dir).generate([PROMPT], SamplingConfig(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True))
    assert len(out.output_ids) == STEPS


QWEN3_KEYS = ("norm_topk_prob", "num_experts_per_tok", "num_local_experts", "decoder_sparse_step", "mlp_only_layers",
              "use_sliding_window")


@pytest.mark.parametrize("hf", [{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 8},
                                {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 16}], ids=["qwen3", "qwen3_moe"])
def test_hostile_config_fields_are_a_config_or_one_line(hf):
    """Every key x wrong value of test_hf_config_inputs (and the MoE's own keys) reads or is a one-line error."""
    from test_hf_config_inputs import BASE, HOSTILE, KEYS, read

    from bestiary.core.format.errors import BestiaryError

    read(BASE | hf)
    for key in (*KEYS, *QWEN3_KEYS):
        for value in HOSTILE:
            try:
                read(BASE | hf | {key: value})
            except BestiaryError as err:
                assert "\n" not in str(err), (key, value, str(err))


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_qk_norm_decode_plan_equals_eager_torch(gqa, tmp_path, dtype, tol):
    """Qwen3's decode steps run as the compiled CPU plan (QK-norm as its per-head norm records) and give the torch
    references' logits and tokens: three requests decoded together, fp32 and bf16 (test_cpu_plan's comparison)."""
    from test_cpu_plan import PROMPTS, assert_same_generation

    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
    from bestiary.core.kernels import dispatch
    from bestiary.core.kernels.cpu.build import library
    from bestiary.core.runtime.cpu_plan import OP_HEAD_NORM
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    if library() is None:
        pytest.skip("the CPU kernels are not built here")
    _, source, _ = gqa
    llm = LLM(convert(source, tmp_path / "ckpt", ConvertOptions(dtype=dtype), show_progress=False))
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0, ignore_eos=True, output_generation_logits=True)
    planned = llm.generate(PROMPTS, sampling)
    plan = llm.executor.model.__dict__.get("_decode_plans", {}).get(3)
    assert plan is not None, llm.executor.model.decode_plan_status()  # the three requests decoded as one plan
    assert sum(r.op == OP_HEAD_NORM for r in plan.records) == 2 * 2  # q and k, in each of the 2 layers
    with dispatch.kernels_mode("torch"):  # every op on its torch reference, no plan
        eager = llm.generate(PROMPTS, sampling)
    assert_same_generation(planned, eager, dtype, tol)
