"""The Qwen3 architecture plugin (HF Qwen3ForCausalLM: Qwen3-0.6B ... 32B, dense).

LLaMA's tensor names (the loader's default map) plus the per-head `self_attn.q_norm` / `k_norm`
(canonical `attention.q_norm` / `k_norm`, the same section names under `attention`).
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

SPEC = ArchitectureSpec(
    name="Qwen3ForCausalLM",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    config_class="bestiary.models.qwen3.model:Qwen3Config",
    model_class="bestiary.models.qwen3.model:Qwen3ForCausalLM",
    from_hf_config="bestiary.models.qwen3.model:from_hf_config",
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description="Qwen3 (dense): RMSNorm, per-head QK RMSNorm before RoPE, GQA without biases, SwiGLU",
    supports=Supports(),  # no LoRA modules declared: no adapter test for this family yet
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register Qwen3ForCausalLM."""
    register(SPEC)
