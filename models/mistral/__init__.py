"""The Mistral architecture plugin: LLaMA's layout (the loader's default key map) with a sliding window.

HF MistralForCausalLM checkpoints use LLaMA's tensor names. `sliding_window` is the attention
window of every layer (core.kernels.attention_window); it does not cap the sequence length.
"""

from __future__ import annotations

from bestiary.models.llama import LORA  # LLaMA's module names, so LLaMA's PEFT table
from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

SPEC = ArchitectureSpec(
    name="MistralForCausalLM",
    hf_architectures=("MistralForCausalLM",),
    hf_model_types=("mistral",),
    config_class="bestiary.models.mistral.model:MistralConfig",
    model_class="bestiary.models.mistral.model:MistralForCausalLM",
    from_hf_config="bestiary.models.mistral.model:from_hf_config",
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description="Mistral 7B / Nemo: RMSNorm, RoPE, GQA, SwiGLU; sliding-window attention",
    supports=Supports(lora_modules=LORA.modules),
    lora=LORA,
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register MistralForCausalLM."""
    register(SPEC)
