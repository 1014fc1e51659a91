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

# window 8: the 12-token prompt and its decode steps run through the window (core.layers.attention_window).
MISTRAL = {
    "gqa_window": dict(model_type="mistral", **TINY, num_key_value_heads=2, sliding_window=8),
    "head_dim": dict(model_type="mistral", **TINY, num_key_value_heads=1, head_dim=32, sliding_window=None)}
TestMistral = conformance("MistralForCausalLM", MISTRAL)

QWEN2 = {"gqa": dict(model_type="qwen2", **TINY, num_key_value_heads=2),
         "mha_tied": dict(model_type="qwen2", **TINY, num_key_value_heads=4, tie_word_embeddings=True)}
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
QWEN2_MOE = {"softmax_topk": QWEN2_MOE_TINY, "norm_topk_prob": QWEN2_MOE_TINY | dict(norm_topk_prob=True)}
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
