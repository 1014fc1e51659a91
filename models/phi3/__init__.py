"""The Phi-3 architecture plugin (Phi3ForCausalLM: Phi-3 mini / small-context / 128k, Phi-3.5-mini, Phi-4,
Phi-4-mini).

LLaMA's tensor names except two fused projections: `self_attn.qkv_proj` ([Q; K; V] rows), cut into this
rank's [Q_r; K_r; V_r] by `fused_qkv`, and `mlp.gate_up_proj` ([gate; up] rows), read by both mlp.fc
(the first half, `gate_rows`) and mlp.gate (the second, `up_rows`), each this rank's rows of its half.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

KEY_MAP = {"qkv": "qkv_proj", "fc": "gate_up_proj", "gate": "gate_up_proj"}  # over the loader's default (LLaMA)
HOOKS = "bestiary.core.convert.postprocess"

SPEC = ArchitectureSpec(
    name="Phi3ForCausalLM",
    hf_architectures=("Phi3ForCausalLM",),
    hf_model_types=("phi3",),
    config_class="bestiary.models.phi3.model:Phi3Config",
    model_class="bestiary.models.phi3.model:Phi3ForCausalLM",
    from_hf_config="bestiary.models.phi3.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={"*.attention.qkv.*": f"{HOOKS}:fused_qkv", "*.mlp.fc.*": f"{HOOKS}:gate_rows",
                 "*.mlp.gate.*": f"{HOOKS}:up_rows"},
    description="Phi-3 / 3.5 / 4: fused qkv_proj and gate_up_proj, RMSNorm, GQA, SwiGLU, LongRoPE (short / long "
                "factors switched by length, attention scaling), partial rotary, sliding window",
    supports=Supports(),  # no LoRA modules declared: PEFT's fused qkv_proj / gate_up_proj have no split yet
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register Phi3ForCausalLM."""
    register(SPEC)
