"""The Qwen-1 architecture plugin (remote code: QWenLMHeadModel, Qwen-1.8B/7B/14B/72B).

HF Qwen-1 checkpoints: transformer.wte, transformer.h.N.{ln_1, attn.c_attn (fused [Q; K; V] rows,
with bias), attn.c_proj, ln_2, mlp.w1, mlp.w2, mlp.c_proj}, transformer.ln_f, lm_head. The MLP is
c_proj(w1(x) * silu(w2(x))): w2 is the activated branch (canonical fc), w1 the linear one (gate).
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

# Canonical section -> HF Qwen-1 section.
KEY_MAP = {
    "transformer": "transformer",
    "vocab_embedding": "wte",
    "layers": "h",
    "input_layernorm": "ln_1",
    "attention": "attn",
    "qkv": "c_attn",
    "dense": "c_proj",
    "post_layernorm": "ln_2",
    "fc": "w2",
    "gate": "w1",
    "proj": "c_proj",
    "ln_f": "ln_f",
}


SPEC = ArchitectureSpec(
    name="QWenLMHeadModel",
    hf_architectures=("QWenLMHeadModel",),
    hf_model_types=("qwen",),
    config_class="bestiary.models.qwen.model:QwenConfig",
    model_class="bestiary.models.qwen.model:QWenLMHeadModel",
    from_hf_config="bestiary.models.qwen.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={"*.attention.qkv.*": "bestiary.core.convert.postprocess:fused_qkv"},
    description="Qwen-1: fused c_attn with bias, RMSNorm, RoPE, w1 * silu(w2) MLP, logn attention scaling",
    supports=Supports(),  # no LoRA modules declared: no adapter test for this family yet
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register QWenLMHeadModel."""
    register(SPEC)
