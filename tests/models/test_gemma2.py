"""Gemma 2 (models/gemma2) through the conformance kit against transformers' Gemma2ForCausalLM: tiny random
models, prefill + 16 greedy decode steps. The 12-token prompt and its decode steps run past the window of 4 on
the local (even) layers; soft-caps small enough that they bite (|scores| and |logits| reach them)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bestiary.testing import conformance  # noqa: E402

TINY = dict(model_type="gemma2", vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            query_pre_attn_scalar=24)
GEMMA2 = {
    # window 4 on layers 0 and 2, attention and final soft-caps 2 and 3, tied lm_head (HF's default)
    "window_softcaps": TINY | dict(sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    # MHA, no caps (null), a window wider than the sequence, an untied lm_head
    "mha_nocap_untied": TINY | dict(num_key_value_heads=4, attn_logit_softcapping=None, final_logit_softcapping=None,
                                    sliding_window=64, tie_word_embeddings=False, num_hidden_layers=2),
}
TestGemma2 = conformance("Gemma2ForCausalLM", GEMMA2, steps=16)
