"""The conformance kit (bestiary.testing) on built-in architectures, one tiny config each.

The same line a third-party plugin writes; the per-architecture test modules keep the checks
the kit does not make (config switches, architecture-specific broken variants).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bestiary.testing import conformance  # noqa: E402

TestLlama = conformance("LlamaForCausalLM", dict(
    model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5))

# OPT-350m's shape: project_in / project_out (DecoderLM.make_top_level_modules), post-norm layers.
TestOPT = conformance("OPTForCausalLM", dict(
    model_type="opt", vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=64, do_layer_norm_before=False, word_embed_proj_dim=16))

# gpt-oss without its attention biases, every layer full (sink logits, clamped SwiGLU experts with biases);
# the banded / YaRN variants and the mechanism checks: tests/models/test_zoo_gpt_oss.py.
TestGptOss = conformance("GptOssForCausalLM", dict(
    model_type="gpt_oss", vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    attention_bias=False, layer_types=["full_attention"] * 2, swiglu_limit=1.0, max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 150000.0}))

# DeepSeek-V3's shape: latent attention with the q_lora path (latent KV cache), layer 0 dense, then sigmoid +
# noaux_tc grouped routing with shared experts; the V2 variants, YaRN and the mechanism checks:
# tests/models/test_zoo_deepseek.py.
TestDeepseekV3 = conformance("DeepseekV3ForCausalLM", dict(
    model_type="deepseek_v3", vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, max_position_embeddings=128))
