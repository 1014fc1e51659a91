"""The Qwen2 architecture plugin: LLaMA's tensor names (the loader's default map), biases on q, k, v."""

from __future__ import annotations

from bestiary.models.llama import LORA  # LLaMA's module names, so LLaMA's PEFT table
from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

SPEC = ArchitectureSpec(
    name="Qwen2ForCausalLM",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    config_class="bestiary.models.qwen2.model:Qwen2Config",
    model_class="bestiary.models.qwen2.model:Qwen2ForCausalLM",
    from_hf_config="bestiary.models.qwen2.model:from_hf_config",
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description="Qwen1.5 / Qwen2 / Qwen2.5: RMSNorm, RoPE, GQA with q/k/v biases, SwiGLU",
    supports=Supports(lora_modules=LORA.modules),
    lora=LORA,
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register Qwen2ForCausalLM."""
    register(SPEC)
