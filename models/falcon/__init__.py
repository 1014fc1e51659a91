"""The Falcon architecture plugin, registered through the `bestiary.architectures` entry point.

HF Falcon checkpoints (FalconForCausalLM, and the older RWForCausalLM / RefinedWeb* ones)
keep one fused transformer.h.N.self_attention.query_key_value per layer whose rows are
interleaved per head (classic), per kv group (new decoder architecture) or already
[Q; K; V] (classic multi-query); `weights.qkv_to_head_major` reorders them at convert.
The norms are named by layout: input_layernorm (one norm), ln_attn + ln_mlp (two
parallel norms), input_layernorm + post_attention_layernorm (sequential attention/MLP).
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, LoraTargets, Supports


def attention_norm_name(config) -> str:
    """HF name of the norm the attention reads: ln_attn with two parallel norms (40B/180B),
    else input_layernorm."""
    two_norms = config.parallel_attention and config.num_ln_in_parallel_attn == 2
    return "ln_attn" if two_norms else "input_layernorm"


# Canonical section -> HF Falcon section (a callable is evaluated with the model config).
KEY_MAP = {
    "transformer": "transformer",
    "vocab_embedding": "word_embeddings",
    "layers": "h",
    "ln_f": "ln_f",
    "lm_head": "lm_head",
    "attention": "self_attention",
    "qkv": "query_key_value",
    "dense": "dense",
    "input_layernorm": attention_norm_name,
    "mlp_layernorm": "ln_mlp",
    "post_layernorm": "post_attention_layernorm",
    "fc": "dense_h_to_4h",
    "proj": "dense_4h_to_h",
}

# HF PEFT module -> LoRA module (query_key_value's lora_B rows are reordered like the weight's).
LORA = LoraTargets({
    "query_key_value": "attn_qkv", "dense": "attn_dense", "dense_h_to_4h": "mlp_h_to_4h",
    "dense_4h_to_h": "mlp_4h_to_h",
}, hf_layers=("transformer.h",))

SPEC = ArchitectureSpec(
    name="FalconForCausalLM",
    hf_architectures=("FalconForCausalLM", "RWForCausalLM"),
    hf_model_types=("falcon", "RefinedWeb", "RefinedWebModel"),
    config_class="bestiary.models.falcon.model:FalconConfig",
    model_class="bestiary.models.falcon.model:FalconForCausalLM",
    from_hf_config="bestiary.models.falcon.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={"*.attention.qkv.*": "bestiary.models.falcon.weights:qkv_to_head_major"},
    description=(
        "Falcon 7B/40B/180B, RW: parallel attention with one or two LayerNorms (new decoder), MQA/GQA "
        "(kv heads replicated when fewer than tp), RoPE or ALiBi, with or without biases"
    ),
    supports=Supports(tensor_parallel=True, pipeline_parallel=True, lora_modules=LORA.modules),
    lora=LORA,
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register FalconForCausalLM."""
    register(SPEC)
