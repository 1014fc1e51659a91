"""The GPT-2 architecture plugin (HF GPT2LMHeadModel).

HF GPT-2 keeps its linears as Conv1D, weight (in, out): the fused c_attn [hidden, 3 hidden]
(columns [Q | K | V]), c_proj, c_fc and the MLP's c_proj are transposed to (out, in) on
convert (the loader slices such a source along the other dim for TP). The lm_head is tied to
wte and not stored.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

# Canonical section -> HF GPT-2 section.
KEY_MAP = {
    "transformer": "transformer",
    "vocab_embedding": "wte",
    "position_embedding": "wpe",
    "layers": "h",
    "input_layernorm": "ln_1",
    "attention": "attn",
    "qkv": "c_attn",
    "dense": "c_proj",
    "post_layernorm": "ln_2",
    "fc": "c_fc",
    "proj": "c_proj",
    "ln_f": "ln_f",
}

TRANSPOSE = "bestiary.core.convert.postprocess:transpose"


SPEC = ArchitectureSpec(
    name="GPT2LMHeadModel",
    hf_architectures=("GPT2LMHeadModel",),
    hf_model_types=("gpt2",),
    config_class="bestiary.models.gpt2.model:GPT2Config",
    model_class="bestiary.models.gpt2.model:GPT2LMHeadModel",
    from_hf_config="bestiary.models.gpt2.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={
        "*.attention.qkv.*": "bestiary.core.convert.postprocess:fused_qkv_transposed",
        "*.attention.dense.weight": TRANSPOSE,
        "*.mlp.fc.weight": TRANSPOSE,
        "*.mlp.proj.weight": TRANSPOSE,
    },
    ignored_source_keys=("*.attn.bias", "*.attn.masked_bias"),  # causal-mask buffers of older transformers
    description="GPT-2 / DistilGPT-2: learned positions, LayerNorm, fused Conv1D c_attn, GELU MLP, tied lm_head",
    supports=Supports(),  # no LoRA modules declared: no adapter test for this family yet
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register GPT2LMHeadModel."""
    register(SPEC)
