"""The conformance kit (bestiary.testing) on the built-in families transformers has a class for:
Mistral, Qwen2, Qwen2-MoE, GPT-2, BLOOM, Exaone4 — tiny random configs, each variant one case.

Qwen-1 and Baichuan2 (remote code, no transformers class) are in test_zoo_remote.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bestiary.testing import conformance  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)

# window 8: the 12-token prompt and its decode steps run through the window (core.kernels.attention_window).
MISTRAL = {
    "gqa_window": dict(model_type="mistral", **TINY, num_key_value_heads=2, sliding_window=8),
    "head_dim": dict(model_type="mistral", **TINY, num_key_value_heads=1, head_dim=32, sliding_window=None)}
TestMistral = conformance("MistralForCausalLM", MISTRAL)

# gqa_window: use_sliding_window with max_window_layers 1, so (transformers' rule) layer 0 is full and
# layer 1 attends through window 8 < the 12-token prompt.
QWEN2 = {"gqa": dict(model_type="qwen2", **TINY, num_key_value_heads=2),
         "mha_tied": dict(model_type="qwen2", **TINY, num_key_value_heads=4, tie_word_embeddings=True),
         "gqa_window": dict(model_type="qwen2", **TINY, num_key_value_heads=2, use_sliding_window=True,
                            sliding_window=8, max_window_layers=1)}
TestQwen2 = conformance("Qwen2ForCausalLM", QWEN2)

GPT2_TINY = dict(model_type="gpt2", vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=128)
GPT2 = {"gpt2": GPT2_TINY,
        "inverse_layer_scale": GPT2_TINY | dict(n_inner=96, scale_attn_by_inverse_layer_idx=True,
                                                activation_function="relu")}
TestGPT2 = conformance("GPT2LMHeadModel", GPT2)

# 6 heads: ALiBi slopes of a head count that is not a power of two (the interleaved extra slopes).
BLOOM_TINY = dict(model_type="bloom", vocab_size=96, hidden_size=64, n_layer=2, n_head=4)
BLOOM = {"mha": BLOOM_TINY, "six_heads": BLOOM_TINY | dict(hidden_size=48, n_head=6)}
TestBloom = conformance("BloomForCausalLM", BLOOM)

QWEN2_MOE_TINY = dict(model_type="qwen2_moe", **TINY, num_key_value_heads=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
# window: use_sliding_window, max_window_layers 28 (default): transformers' Qwen2-MoE rule windows the even
# layers below it, so layer 0 attends through window 8 and layer 1 sees every key.
QWEN2_MOE = {"softmax_topk": QWEN2_MOE_TINY, "norm_topk_prob": QWEN2_MOE_TINY | dict(norm_topk_prob=True),
             "window": QWEN2_MOE_TINY | dict(use_sliding_window=True, sliding_window=8)}
TestQwen2Moe = conformance("Qwen2MoeForCausalLM", QWEN2_MOE)

# Hybrid: layers 0-2 local (RoPE, window 8 < the prompt), layer 3 global (NoPE); and all-RoPE without a window.
EXAONE4_TINY = dict(model_type="exaone4", **TINY | dict(num_hidden_layers=4), num_key_value_heads=2)
EXAONE4 = {
    "hybrid_window_nope": EXAONE4_TINY | dict(sliding_window=8, sliding_window_pattern=4),
    "all_rope_tied": EXAONE4_TINY | dict(sliding_window=None, layer_types=["full_attention"] * 4,
                                         tie_word_embeddings=True)}
TestExaone4 = conformance("Exaone4ForCausalLM", EXAONE4)

# architecture -> its cases, for benchmarks/zoo_parity.py (the closing parity table).
ZOO = {"MistralForCausalLM": MISTRAL, "Qwen2ForCausalLM": QWEN2, "Qwen2MoeForCausalLM": QWEN2_MOE,
       "GPT2LMHeadModel": GPT2, "BloomForCausalLM": BLOOM, "Exaone4ForCausalLM": EXAONE4}


# --- Qwen2 / Qwen2-MoE sliding windows: the layers transformers picks, and the window matters ---------------


@pytest.mark.parametrize("architecture,case", [("Qwen2ForCausalLM", "gqa_window"), ("Qwen2MoeForCausalLM", "window")])
def test_qwen2_window_layers_follow_hf_and_matter(architecture, case, tmp_path):
    """The engine windows exactly the layers HF's config marks sliding_attention (one full, one windowed),
    matches HF within the kit's bound, and misses by 100x with the window ignored or put on every layer."""
    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.parity import reference_diffs
    from bestiary.testing.references import as_reference
    from bestiary.testing.suite import PROMPT

    reference = as_reference(ZOO[architecture][case])
    engine = Engine.load(convert(reference.save(tmp_path / "src"), tmp_path / "ckpt", show_progress=False))
    window = reference.model.config.sliding_window
    expected = [window if t == "sliding_attention" else 0 for t in reference.model.config.layer_types]
    assert engine.model.attention_windows == expected and sorted(set(expected)) == [0, window]
    assert window < len(PROMPT)  # the window matters within the prompt
    diff, scale = reference_diffs(engine, reference.logits, PROMPT, 4)
    bound = 1e-4 * max(1.0, scale)
    assert diff <= bound, f"max|ours - HF| {diff:.3e} > {bound:.3e}"
    attns = [m for m in engine.model.modules() if hasattr(m, "window")]
    for wrong in ([0, 0], [window, window]):  # no window at all; the window on every layer
        for attn, w in zip(attns, wrong, strict=True):
            attn.window = w
        miss = reference_diffs(engine, reference.logits, PROMPT, 1)[0]
        assert miss > 100 * bound, f"windows {wrong}: {miss:.3e} went unnoticed"


@pytest.mark.parametrize("model_type", ["qwen2", "qwen2_moe"])
def test_qwen2_window_layers_from_published_fields(model_type):
    """A config.json without layer_types (as published): bestiary's per-layer windows equal the ones
    transformers' config derives from use_sliding_window / sliding_window / max_window_layers."""
    import transformers

    from bestiary.core.format.config import Mapping
    from bestiary.core.kernels.attention_window import layer_window
    from bestiary.models.qwen2.model import from_hf_config as qwen2
    from bestiary.models.qwen2_moe.model import from_hf_config as qwen2_moe

    read = {"qwen2": qwen2, "qwen2_moe": qwen2_moe}[model_type]
    base = dict(TINY, num_hidden_layers=6, num_key_value_heads=2)
    for use in (False, True):
        for layers in ({}, {"max_window_layers": 0}, {"max_window_layers": 3}, {"max_window_layers": 28}):
            fields = base | dict(use_sliding_window=use, sliding_window=16) | layers
            hf = transformers.AutoConfig.for_model(model_type, **fields)
            expected = [16 if t == "sliding_attention" and hf.sliding_window else 0 for t in hf.layer_types]
            config = read(fields | {"model_type": model_type}, "float32", Mapping())
            assert [layer_window(config, i) for i in range(6)] == expected, (use, layers)
