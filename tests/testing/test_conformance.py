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
