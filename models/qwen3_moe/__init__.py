"""The Qwen3-MoE architecture plugin (HF Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B).

HF checkpoints keep Qwen3's attention names (q/k/v/o without biases, per-head `self_attn.q_norm` /
`k_norm`) and, under `mlp`, the router `gate` and one matrix per expert
`experts.{e}.{gate,up,down}_proj` (no shared expert). The key map fans the stacked canonical
experts out to the E sources (`PerExpert`), as Qwen2-MoE's does.
"""

from __future__ import annotations

from bestiary.models.qwen2_moe import KEY_MAP, STACK
from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

SPEC = ArchitectureSpec(
    name="Qwen3MoeForCausalLM",
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_types=("qwen3_moe",),
    config_class="bestiary.models.qwen3_moe.model:Qwen3MoeConfig",
    model_class="bestiary.models.qwen3_moe.model:Qwen3MoeForCausalLM",
    from_hf_config="bestiary.models.qwen3_moe.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={
        "*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0",
        "*.mlp.fc.weight": STACK,
        "*.mlp.gate.weight": STACK,
        "*.mlp.proj.weight": STACK,
    },
    description="Qwen3-MoE: per-head QK RMSNorm, GQA without biases, top-k routed SwiGLU experts (norm_topk_prob)",
    supports=Supports(tensor_parallel=True, pipeline_parallel=True, expert_parallel=True),
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register Qwen3MoeForCausalLM."""
    register(SPEC)
