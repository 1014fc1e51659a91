"""The LLaMA architecture plugin, registered through the `bestiary.architectures` entry point.

Mistral is an alias (vLLM's registry style): HF MistralForCausalLM checkpoints use LLaMA's tensor
names and layers, plus a sliding window (models.llama.model), so this spec claims them too and
converts them to LlamaForCausalLM checkpoints.
"""

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
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_model_types=("llama", "mistral"),
    gguf_architectures=("llama",),
    config_class="bestiary.models.llama.model:LlamaConfig",
    model_class="bestiary.models.llama.model:LlamaForCausalLM",
    from_hf_config="bestiary.models.llama.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description="LLaMA 1/2/3, SmolLM, Mistral: RMSNorm, RoPE (linear/llama3 scaling), GQA, SwiGLU, sliding window",
    supports=Supports(lora_modules=LORA.modules),
    lora=LORA,
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register LlamaForCausalLM."""
    register(SPEC)
