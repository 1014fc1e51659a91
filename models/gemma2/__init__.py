"""The Gemma 2 architecture plugin (transformers' Gemma2ForCausalLM).

LLaMA's tensor names (the loader's default map), plus the norms after each sublayer:
`post_attention_layernorm` (the attention's output norm here, canonical `post_layernorm`),
`pre_feedforward_layernorm` and `post_feedforward_layernorm`.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

SPEC = ArchitectureSpec(
    name="Gemma2ForCausalLM",
    hf_architectures=("Gemma2ForCausalLM",),
    hf_model_types=("gemma2",),
    config_class="bestiary.models.gemma2.model:Gemma2Config",
    model_class="bestiary.models.gemma2.model:Gemma2ForCausalLM",
    from_hf_config="bestiary.models.gemma2.model:from_hf_config",
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description=(
        "Gemma 2: sandwich RMSNorms (1 + w), embeddings * sqrt(hidden), GeGLU, GQA scaled by "
        "query_pre_attn_scalar, attention and final logit soft-caps, alternating local (window) / global layers"
    ),
    supports=Supports(),  # no LoRA modules declared: no adapter test for this family yet
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register Gemma2ForCausalLM."""
    register(SPEC)
