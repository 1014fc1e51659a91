"""The Qwen2-MoE architecture plugin (HF Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

HF checkpoints keep LLaMA's attention names (q/k/v with biases) and, under `mlp`, the router
`gate`, one matrix per expert `experts.{e}.{gate,up,down}_proj`, the shared expert
`shared_expert.{gate,up,down}_proj` and its sigmoid gate `shared_expert_gate` [1, H]. The key
map fans the stacked canonical experts out to the E sources (`PerExpert`); the shared expert
has a layer map of its own.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, PerExpert, Supports

# Canonical section -> HF Qwen2-MoE section, over the loader's default (LLaMA) map.
KEY_MAP = {
    "router": "gate",
    "fc": PerExpert("gate_proj"),
    "gate": PerExpert("up_proj"),
    "proj": PerExpert("down_proj"),
}
SHARED_EXPERT_MAP = {"fc": "gate_proj", "gate": "up_proj", "proj": "down_proj"}

STACK = "bestiary.core.layers.moe:stack_experts"

SPEC = ArchitectureSpec(
    name="Qwen2MoeForCausalLM",
    hf_architectures=("Qwen2MoeForCausalLM",),
    hf_model_types=("qwen2_moe",),
    config_class="bestiary.models.qwen2_moe.model:Qwen2MoeConfig",
    model_class="bestiary.models.qwen2_moe.model:Qwen2MoeForCausalLM",
    from_hf_config="bestiary.models.qwen2_moe.model:from_hf_config",
    key_map=KEY_MAP,
    layer_key_maps={"*.mlp.shared_expert.*": SHARED_EXPERT_MAP},
    postprocess={
        "*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0",
        "*.mlp.fc.weight": STACK,
        "*.mlp.gate.weight": STACK,
        "*.mlp.proj.weight": STACK,
    },
    description="Qwen1.5-MoE / Qwen2-MoE: top-k routed SwiGLU experts + a sigmoid-gated shared expert, q/k/v bias",
    supports=Supports(tensor_parallel=True, pipeline_parallel=True, expert_parallel=True),
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register Qwen2MoeForCausalLM."""
    register(SPEC)
