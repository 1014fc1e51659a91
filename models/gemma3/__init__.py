"""The Gemma 3 text architecture plugin (transformers' Gemma3ForCausalLM, model_type gemma3_text).

Gemma 2's tensor names plus per-head `self_attn.q_norm` / `k_norm`. The multimodal
Gemma3ForConditionalGeneration (its text under `language_model`) is not claimed.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

SPEC = ArchitectureSpec(
    name="Gemma3ForCausalLM",
    hf_architectures=("Gemma3ForCausalLM",),
    hf_model_types=("gemma3_text",),
    config_class="bestiary.models.gemma3.model:Gemma3Config",
    model_class="bestiary.models.gemma3.model:Gemma3ForCausalLM",
    from_hf_config="bestiary.models.gemma3.model:from_hf_config",
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description=(
        "Gemma 3 (text): Gemma 2's sandwich norms, scales and GeGLU with QK-norm (1 + w); local (window, "
        "rope_local_base_freq) / global (rope_theta, rope scaling) layers 5:1"
    ),
    supports=Supports(),  # no LoRA modules declared: no adapter test for this family yet
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register Gemma3ForCausalLM."""
    register(SPEC)
