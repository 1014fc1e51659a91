"""The EXAONE 4.0 architecture plugin (transformers 5's Exaone4ForCausalLM).

LLaMA's tensor names, plus per-head `self_attn.q_norm` / `k_norm` and the sublayer output norms
`post_attention_layernorm` / `post_feedforward_layernorm` (no input norm).
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

SPEC = ArchitectureSpec(
    name="Exaone4ForCausalLM",
    hf_architectures=("Exaone4ForCausalLM",),
    hf_model_types=("exaone4",),
    config_class="bestiary.models.exaone4.model:Exaone4Config",
    model_class="bestiary.models.exaone4.model:Exaone4ForCausalLM",
    from_hf_config="bestiary.models.exaone4.model:from_hf_config",
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description=(
        "EXAONE 4.0: QK-norm, output-normed sublayers, GQA, SwiGLU; hybrid local (RoPE) / global (NoPE) "
        "layers, the local ones through the sliding window"
    ),
    supports=Supports(),  # no LoRA modules declared: no adapter test for this family yet
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register Exaone4ForCausalLM."""
    register(SPEC)
