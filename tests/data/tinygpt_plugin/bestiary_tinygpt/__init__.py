"""TinyGPT, a bestiary architecture plugin: LLaMA with LayerNorm instead of RMSNorm and a GELU MLP.

The source checkpoints (written by TinyGPT's own training code) look like

    config.json            {"arch": "tinygpt", "dim": ..., "n_layers": ..., ...}
    model.safetensors      tok_embeddings.weight, layers.{i}.attn_norm.{weight,bias},
                           layers.{i}.attn.wqkv.{weight,bias}  (q, k, v interleaved per head),
                           layers.{i}.attn.wo.{weight,bias}, layers.{i}.ffn_norm.{weight,bias},
                           layers.{i}.ffn.up.{weight,bias}, layers.{i}.ffn.down.{weight,bias},
                           norm.{weight,bias}, output.weight
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

NAME = "TinyGPTForCausalLM"

# Canonical section -> TinyGPT section. None drops the section: TinyGPT's names have no
# "transformer." prefix. Sections not listed map to themselves ("layers", "weight", "bias").
KEY_MAP = {
    "transformer": None,
    "vocab_embedding": "tok_embeddings",
    "input_layernorm": "attn_norm",
    "attention": "attn",
    "qkv": "wqkv",
    "dense": "wo",
    "post_layernorm": "ffn_norm",
    "mlp": "ffn",
    "fc": "up",
    "proj": "down",
    "ln_f": "norm",
    "lm_head": "output",
}

SPEC = ArchitectureSpec(
    name=NAME,
    hf_architectures=(NAME,),
    hf_model_types=("tinygpt",),
    config_class="bestiary_tinygpt.config:TinyGPTConfig",
    model_class="bestiary_tinygpt.model:TinyGPTForCausalLM",
    from_hf_config="bestiary_tinygpt.config:from_hf_config",
    key_map=KEY_MAP,
    postprocess={"*.attention.qkv.*": "bestiary_tinygpt.model:qkv_from_per_head"},
    description="TinyGPT: LLaMA with LayerNorm and a GELU MLP, biases everywhere, MHA",
    supports=Supports(tensor_parallel=True, pipeline_parallel=True),
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register TinyGPTForCausalLM."""
    register(SPEC)


@hookimpl
def bestiary_claim_hf_config(hf_config: dict) -> str | None:
    """TinyGPT's config.json has neither `architectures` nor `model_type`, only "arch": "tinygpt"."""
    return NAME if hf_config.get("arch") == "tinygpt" else None
