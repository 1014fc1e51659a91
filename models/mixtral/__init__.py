"""The Mixtral architecture plugin, registered through the `bestiary.architectures` entry point.

HF checkpoints (what transformers' save_pretrained writes) keep one matrix per expert:
model.layers.N.block_sparse_moe.experts.M.{w1,w2,w3}.weight and the router
block_sparse_moe.gate.weight. The key map fans each stacked canonical tensor out to the
E per-expert sources (E from the config) and `stack_experts` stacks them.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import DEFAULT_KEY_MAP, ArchitectureSpec, LoraTargets, PerExpert, Supports

# Canonical section -> HF Mixtral section.
KEY_MAP = {
    **DEFAULT_KEY_MAP,
    "mlp": "block_sparse_moe",
    "router": "gate",
    "fc": PerExpert("w1"),  # gate_proj of each expert
    "gate": PerExpert("w3"),  # up_proj
    "proj": PerExpert("w2"),  # down_proj
}

# HF PEFT module -> LoRA module (experts.{e}.w1 etc.: one adapter per expert; gate is the router).
LORA = LoraTargets({
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
    "gate": "moe_router", "w1": "moe_h_to_4h", "w3": "moe_gate", "w2": "moe_4h_to_h",
})

STACK = "bestiary.core.layers.moe:stack_experts"

SPEC = ArchitectureSpec(
    name="MixtralForCausalLM",
    hf_architectures=("MixtralForCausalLM",),
    hf_model_types=("mixtral",),
    config_class="bestiary.models.mixtral.model:MixtralConfig",
    model_class="bestiary.models.mixtral.model:MixtralForCausalLM",
    from_hf_config="bestiary.models.mixtral.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={
        "*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0",
        "*.mlp.fc.weight": STACK,
        "*.mlp.gate.weight": STACK,
        "*.mlp.proj.weight": STACK,
    },
    description="Mixtral MoE: top-k routed SwiGLU experts (TP along the expert FFN dim), RoPE, GQA, RMSNorm",
    supports=Supports(tensor_parallel=True, pipeline_parallel=True, expert_parallel=True, lora_modules=LORA.modules),
    lora=LORA,
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register MixtralForCausalLM."""
    register(SPEC)
