"""The BLOOM architecture plugin (HF BloomForCausalLM).

query_key_value rows are interleaved per head ([q_h k_h v_h] for each head h), reordered to
[Q; K; V] on convert (`per_head_qkv`); the embedding LayerNorm is `transformer.ln_embed`, the
tied lm_head is not stored. Key map as in the TensorRT-LLM weights-loader example for BLOOM.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

# Canonical section -> HF BLOOM section.
KEY_MAP = {
    "transformer": "transformer",
    "layers": "h",
    "vocab_embedding": "word_embeddings",
    "ln_embed": "word_embeddings_layernorm",
    "attention": "self_attention",
    "qkv": "query_key_value",
    "dense": "dense",
    "post_layernorm": "post_attention_layernorm",
    "fc": "dense_h_to_4h",
    "proj": "dense_4h_to_h",
    "ln_f": "ln_f",
}


SPEC = ArchitectureSpec(
    name="BloomForCausalLM",
    hf_architectures=("BloomForCausalLM",),
    hf_model_types=("bloom",),
    config_class="bestiary.models.bloom.model:BloomConfig",
    model_class="bestiary.models.bloom.model:BloomForCausalLM",
    from_hf_config="bestiary.models.bloom.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:per_head_qkv"},
    description="BLOOM: ALiBi, embedding LayerNorm, per-head interleaved query_key_value, GELU MLP, tied lm_head",
    supports=Supports(),  # no LoRA modules declared: no adapter test for this family yet
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register BloomForCausalLM."""
    register(SPEC)
