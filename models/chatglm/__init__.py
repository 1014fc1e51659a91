"""The ChatGLM architecture plugin: v1 (chatglm-6b) and v2/3 (chatglm2/3-6b, HF glm / GLM-4).

THUDM's v1 and v2/3 config.json both say architectures ["ChatGLMModel"] and model_type
"chatglm"; `bestiary_claim_hf_config` tells them apart (v1 has position_encoding_2d,
v2/3 has multi_query_group_num).
"""

from __future__ import annotations

from bestiary.core.format.errors import ConfigError
from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, LoraTargets, Supports

_HOOKS = "bestiary.models.chatglm.weights"
V1_NAME = "ChatGLMForCausalLM"
V2_NAME = "ChatGLM2ForCausalLM"

# Canonical section -> THUDM chatglm-6b section.
V1_KEY_MAP = {
    "transformer": "transformer",
    "vocab_embedding": "word_embeddings",
    "ln_f": "final_layernorm",
    "lm_head": "lm_head",
    "attention": "attention",
    "qkv": "query_key_value",
    "dense": "dense",
    "fc": "dense_h_to_4h",
    "proj": "dense_4h_to_h",
    "input_layernorm": "input_layernorm",
    "post_layernorm": "post_attention_layernorm",
}

# Canonical section -> THUDM chatglm2/3-6b section (mlp.fc and mlp.gate are halves of one tensor).
V2_KEY_MAP = {
    "transformer": "transformer",
    "vocab_embedding": "embedding.word_embeddings",
    "layers": "encoder.layers",
    "ln_f": "encoder.final_layernorm",
    "lm_head": "transformer.output_layer",
    "attention": "self_attention",
    "qkv": "query_key_value",
    "dense": "dense",
    "fc": "dense_h_to_4h",
    "gate": "dense_h_to_4h",
    "proj": "dense_4h_to_h",
    "input_layernorm": "input_layernorm",
    "post_layernorm": "post_attention_layernorm",
}

# Canonical section -> transformers GlmForCausalLM section (sources with model_type "glm").
GLM_HF_KEY_MAP = {
    "transformer": "model",
    "vocab_embedding": "embed_tokens",
    "layers": "layers",
    "ln_f": "norm",
    "lm_head": "lm_head",
    "attention": "self_attn",
    "qkv": ["q_proj", "k_proj", "v_proj"],
    "dense": "o_proj",
    "fc": "gate_up_proj",
    "gate": "gate_up_proj",
    "proj": "down_proj",
    "input_layernorm": "input_layernorm",
    "post_layernorm": "post_attention_layernorm",
}

# HF PEFT module -> LoRA module. v1: THUDM chatglm-6b names.
V1_LORA = LoraTargets({
    "query_key_value": "attn_qkv", "dense": "attn_dense", "dense_h_to_4h": "mlp_h_to_4h",
    "dense_4h_to_h": "mlp_4h_to_h",
}, hf_layers=("transformer.layers",))

# v2/3: THUDM names (dense_h_to_4h holds gate and up: its lora_B rows split in halves) and HF glm names.
V2_LORA = LoraTargets({
    "query_key_value": "attn_qkv", "dense": "attn_dense", "dense_h_to_4h": ("mlp_h_to_4h", "mlp_gate"),
    "dense_4h_to_h": "mlp_4h_to_h",
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
    "gate_up_proj": ("mlp_h_to_4h", "mlp_gate"), "down_proj": "mlp_4h_to_h",
}, hf_layers=("transformer.encoder.layers", "model.layers"))

V1_SPEC = ArchitectureSpec(
    name=V1_NAME,
    hf_architectures=("ChatGLMModel", "ChatGLMForConditionalGeneration"),
    hf_model_types=("chatglm",),
    config_class="bestiary.models.chatglm.model:ChatGLMConfig",
    model_class="bestiary.models.chatglm.model:ChatGLMForCausalLM",
    from_hf_config="bestiary.models.chatglm.model:from_hf_config_v1",
    key_map=V1_KEY_MAP,
    postprocess={"*.attention.qkv.*": f"{_HOOKS}:qkv_per_head"},
    ignored_source_keys=("transformer.layers.*.attention.rotary_emb.inv_freq",),
    description="ChatGLM-6B (v1): 2D rotary with the gMASK token, prefix-LM mask, alpha-scaled post-LN residuals, GELU",
    supports=Supports(lora_modules=V1_LORA.modules),
    lora=V1_LORA,
)

V2_SPEC = ArchitectureSpec(
    name=V2_NAME,
    hf_architectures=("ChatGLMModel", "ChatGLMForConditionalGeneration", "GlmForCausalLM"),
    hf_model_types=("chatglm", "glm"),
    config_class="bestiary.models.chatglm.model:ChatGLM2Config",
    model_class="bestiary.models.chatglm.model:ChatGLM2ForCausalLM",
    from_hf_config="bestiary.models.chatglm.model:from_hf_config_v2",
    key_map=V2_KEY_MAP,
    source_key_maps={"glm": GLM_HF_KEY_MAP},
    postprocess={
        "*.attention.qkv.*": f"{_HOOKS}:qkv_v2",
        "*.mlp.fc.*": f"{_HOOKS}:gate_half",
        "*.mlp.gate.*": f"{_HOOKS}:up_half",
    },
    ignored_source_keys=("transformer.rotary_pos_emb.inv_freq",),
    description="ChatGLM2/3-6B, GLM-4 (HF glm): RMSNorm, SwiGLU, GQA, interleaved rotary on half of each head",
    supports=Supports(lora_modules=V2_LORA.modules),
    lora=V2_LORA,
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register ChatGLMForCausalLM (v1) and ChatGLM2ForCausalLM (v2/3, glm)."""
    register(V1_SPEC)
    register(V2_SPEC)


def _is_thudm_chatglm(hf_config: dict) -> bool:
    """model_type "chatglm" or a THUDM architecture name (a malformed `architectures`, refused where
    config.json is read, claims nothing here)."""
    archs = hf_config.get("architectures")
    names = {a for a in archs if isinstance(a, str)} if isinstance(archs, list) else set()
    return hf_config.get("model_type") == "chatglm" or bool(names & {"ChatGLMModel", "ChatGLMForConditionalGeneration"})


@hookimpl
def bestiary_claim_hf_config(hf_config: dict) -> str | None:
    """v1 for a THUDM config with position_encoding_2d, v2/3 for one with multi_query_group_num."""
    if not _is_thudm_chatglm(hf_config):
        return None
    if "position_encoding_2d" in hf_config:
        return V1_NAME
    if "multi_query_group_num" in hf_config:
        return V2_NAME
    raise ConfigError(
        "a THUDM ChatGLM config.json with neither position_encoding_2d (v1) nor multi_query_group_num (v2/3); "
        f"pass --architecture {V1_NAME} or {V2_NAME}"
    )
