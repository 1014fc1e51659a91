"""bestiary's conformance suite on this plugin: tiny random Qwen2 models vs transformers' Qwen2."""

from bestiary.testing import conformance

TINY = dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128)

TestQwen2 = conformance("Qwen2ForCausalLM", {"gqa": TINY | dict(num_key_value_heads=2),
                                             "mha_tied": TINY | dict(num_key_value_heads=4, tie_word_embeddings=True)})
