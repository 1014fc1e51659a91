"""Gemma 3 text (models/gemma3) through the conformance kit against transformers' Gemma3ForCausalLM: tiny random
models, prefill + 16 greedy decode steps past the window of 4. Local layers use RoPE theta rope_local_base_freq
(100 here, so it differs visibly from the global 10^6), global layers the config's (linear-scaled) rope."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bestiary.testing import conformance  # noqa: E402

TINY = dict(model_type="gemma3_text", vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            query_pre_attn_scalar=24, sliding_window=4, rope_local_base_freq=100.0)
GEMMA3 = {
    # layers 0 and 2 local (window 4, theta 100), 1 and 3 global (theta 10^6, linear factor 4); tied lm_head
    "pattern2_linear_rope": TINY | dict(sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # layers 0-1 local, 2 global (pattern 3), a final-logit soft-cap of 3 (transformers' Gemma3 applies no
    # attention soft-cap: the reader refuses one, test_gemma_mechanisms), MHA, untied lm_head
    "pattern3_final_cap_untied": TINY | dict(num_hidden_layers=3, sliding_window_pattern=3, num_key_value_heads=4,
                                             final_logit_softcapping=3.0, tie_word_embeddings=False),
}
TestGemma3 = conformance("Gemma3ForCausalLM", GEMMA3, steps=16)
