"""The OPT architecture plugin, registered through the `bestiary.architectures` entry point.

HF OPT checkpoints (what transformers' save_pretrained writes) keep the decoder under
model.decoder.*; q/k/v are separate projections fused into attention.qkv, fc1/fc2 sit
directly in the layer (no `mlp` section), and the tied lm_head is not stored.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, LoraTargets, Supports

# Canonical section -> HF OPT section.
KEY_MAP = {
    "transformer": "model.decoder",
    "vocab_embedding": "embed_tokens",
    "position_embedding": "embed_positions",
    "project_in": "project_in",
    "project_out": "project_out",
    "ln_f": "final_layer_norm",
    "lm_head": "lm_head",
    "attention": "self_attn",
    "qkv": ["q_proj", "k_proj", "v_proj"],
    "dense": "out_proj",
    "input_layernorm": "self_attn_layer_norm",
    "post_layernorm": "final_layer_norm",
    "mlp": None,
    "fc": "fc1",
    "proj": "fc2",
}

# HF PEFT module -> LoRA module.
LORA = LoraTargets({
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "out_proj": "attn_dense",
    "fc1": "mlp_h_to_4h", "fc2": "mlp_4h_to_h",
}, hf_layers=("model.decoder.layers",))

SPEC = ArchitectureSpec(
    name="OPTForCausalLM",
    hf_architectures=("OPTForCausalLM",),
    hf_model_types=("opt",),
    config_class="bestiary.models.opt.model:OPTConfig",
    model_class="bestiary.models.opt.model:OPTForCausalLM",
    from_hf_config="bestiary.models.opt.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:concat_dim0"},
    description=(
        "OPT 125m-66b: learned positions (offset 2), LayerNorm pre- or post-norm (do_layer_norm_before), "
        "ReLU MLP, project_in/out when word_embed_proj_dim != hidden_size (350m)"
    ),
    supports=Supports(tensor_parallel=True, pipeline_parallel=True, lora_modules=LORA.modules),
    lora=LORA,
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register OPTForCausalLM."""
    register(SPEC)
