"""The LLaMA architecture plugin, registered through the `bestiary.architectures` entry point."""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import DEFAULT_KEY_MAP, ArchitectureSpec, LoraTargets, Supports

# Canonical section -> HF LLaMA section: the loader's default map (TensorRT-LLM's) is LLaMA's.
KEY_MAP = dict(DEFAULT_KEY_MAP)

# HF PEFT module -> LoRA module (TensorRT-LLM names; mlp_h_to_4h is gate_proj = mlp.fc, mlp_gate up_proj = mlp.gate).
LORA = LoraTargets({
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h",
})

SPEC = ArchitectureSpec(
    name="LlamaForCausalLM",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    config_class="bestiary.models.llama.config:LlamaConfig",
    model_class="bestiary.models.llama.model:LlamaForCausalLM",
    from_hf_config="bestiary.models.llama.config:from_hf_config",
    key_map=KEY_MAP,
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description="LLaMA 1/2/3, SmolLM: RMSNorm, RoPE (linear/llama3 scaling), GQA, SwiGLU",
    supports=Supports(lora_modules=LORA.modules),
    lora=LORA,
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register LlamaForCausalLM."""
    register(SPEC)
