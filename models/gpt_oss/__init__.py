"""The gpt-oss architecture plugin (transformers' GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b).

HF checkpoints keep LLaMA's attention names (q/k/v/o, all with biases) plus `self_attn.sinks` [H], one
sink logit per query head (canonical `attention.attn.sink_logits`). The experts are stacked and stored
(in, out): `mlp.experts.gate_up_proj` [E, H, 2I] with gate and up interleaved along 2I (gate the even
columns), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]; the router
`mlp.router` has a bias. OpenAI's own checkpoints hold the expert matrices in MXFP4
(`*_blocks` / `*_scales`), dequantized on read (core.convert.mxfp4) into the same names and layout.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

HOOKS = "bestiary.models.gpt_oss.weights"
# Per canonical expert module: its source tensor names under mlp.experts (layer_key_maps).
EXPERTS: dict[str, dict[str, str | None]] = {
    "*.mlp.fc": {"fc": "experts", "weight": "gate_up_proj", "bias": "gate_up_proj_bias"},
    "*.mlp.gate": {"gate": "experts", "weight": "gate_up_proj", "bias": "gate_up_proj_bias"},
    "*.mlp.proj": {"proj": "experts", "weight": "down_proj", "bias": "down_proj_bias"},
    "*.attention.attn": {"attn": None, "sink_logits": "sinks"},
}

SPEC = ArchitectureSpec(
    name="GptOssForCausalLM",
    hf_architectures=("GptOssForCausalLM",),
    hf_model_types=("gpt_oss",),
    config_class="bestiary.models.gpt_oss.model:GptOssConfig",
    model_class="bestiary.models.gpt_oss.model:GptOssForCausalLM",
    from_hf_config="bestiary.models.gpt_oss.model:from_hf_config",
    layer_key_maps=EXPERTS,
    postprocess={
        "*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0",
        "*.mlp.fc.weight": f"{HOOKS}:gate_columns",
        "*.mlp.gate.weight": f"{HOOKS}:up_columns",
        "*.mlp.fc.bias": f"{HOOKS}:gate_bias",
        "*.mlp.gate.bias": f"{HOOKS}:up_bias",
        "*.mlp.proj.weight": f"{HOOKS}:transpose_experts",
    },
    description=("gpt-oss: attention sink logits per head, alternating banded (window) / full layers, q/k/v/o "
                 "biases, YaRN RoPE, top-k routed experts with biases and a clamped SwiGLU, MXFP4 experts read"),
    supports=Supports(tensor_parallel=True, pipeline_parallel=True, expert_parallel=True),
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register GptOssForCausalLM."""
    register(SPEC)
