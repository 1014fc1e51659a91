"""The DeepSeek-V2 / V3 architecture plugin (HF DeepseekV2ForCausalLM: DeepSeek-V2, V2-Lite, V2.5;
DeepseekV3ForCausalLM: DeepSeek-V3, R1, and models built on them).

HF checkpoints name the latent attention's projections as bestiary's module does (`self_attn.q_proj` or
`q_a_proj` / `q_a_layernorm` / `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`);
a MoE layer's `mlp` holds the router `gate.weight` (and V3's `gate.e_score_correction_bias`), one matrix
per expert `experts.{e}.{gate,up,down}_proj` and the shared experts `shared_experts.{gate,up,down}_proj`;
the first dense layers' `mlp` is LLaMA's. The canonical MoE (`mlp.experts`, core.layers.moe_routing) has
a layer map of its own that drops its `experts` section and fans the stacked experts out (`PerExpert`).

V3's multi-token-prediction layer (`model.layers.61.*` of the 61-layer checkpoints,
num_nextn_predict_layers) is not run: its weights are skipped as transformers skips them.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, PerExpert, Supports

# Canonical section -> HF section under a MoE layer's `mlp.experts` (the loader's default map elsewhere).
EXPERTS_MAP = {
    "experts": None,
    "router": "gate",
    "e_score_correction_bias": "gate.e_score_correction_bias",
    "fc": PerExpert("gate_proj"),
    "gate": PerExpert("up_proj"),
    "proj": PerExpert("down_proj"),
}

STACK = "bestiary.core.layers.moe:stack_experts"
POSTPROCESS = {f"*.mlp.experts.{name}.weight": STACK for name in ("fc", "gate", "proj")}
SUPPORTS = Supports(quant_algos=("W8A16", "W4A16"), tensor_parallel=True, pipeline_parallel=True,
                    expert_parallel=True, kv_cache_quantization=False)  # the pool holds latent rows, not K / V


def spec(version: int) -> ArchitectureSpec:
    """DeepseekV{version}ForCausalLM."""
    name = f"DeepseekV{version}ForCausalLM"
    model = "bestiary.models.deepseek.model"
    return ArchitectureSpec(
        name=name,
        hf_architectures=(name,),
        hf_model_types=(f"deepseek_v{version}",),
        config_class=f"{model}:DeepseekV{version}Config",
        model_class=f"{model}:{name}",
        from_hf_config=f"{model}:from_hf_config_v{version}",
        layer_key_maps={"*.mlp.experts*": EXPERTS_MAP},
        postprocess=POSTPROCESS,
        ignored_source_keys=("model.layers.61.*",) if version == 3 else (),
        description=(f"DeepSeek-V{version}: multi-head latent attention (latent KV cache), "
                     + ("softmax top-k / group-limited" if version == 2 else "sigmoid + correction-bias grouped")
                     + " routed experts + shared experts, first layers dense"),
        supports=SUPPORTS,
    )


SPECS = (spec(2), spec(3))


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register DeepseekV2ForCausalLM and DeepseekV3ForCausalLM."""
    for s in SPECS:
        register(s)
