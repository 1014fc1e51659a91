"""Qwen2 as a third-party bestiary plugin: LLaMA with a bias on q, k and v only.

HF Qwen2 checkpoints use LLaMA's tensor names, which are the loader's default key map.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec

NAME = "Qwen2ForCausalLM"

SPEC = ArchitectureSpec(
    name=NAME,
    hf_architectures=(NAME,),
    hf_model_types=("qwen2",),
    config_class="bestiary_qwen2.model:Qwen2Config",
    model_class="bestiary_qwen2.model:Qwen2ForCausalLM",
    from_hf_config="bestiary_qwen2.model:from_hf_config",
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description="Qwen2 / Qwen2.5: RMSNorm, RoPE, GQA with q/k/v biases, SwiGLU (third-party plugin)",
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register Qwen2ForCausalLM."""
    register(SPEC)
