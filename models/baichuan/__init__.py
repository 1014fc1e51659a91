"""The Baichuan / Baichuan2 architecture plugin (remote code: BaichuanForCausalLM, BaiChuanForCausalLM).

LLaMA's tensor names except the fused `self_attn.W_pack` ([Q; K; V] rows, no bias). Baichuan2's
lm_head is a NormHead: each vocab row is L2-normalised before use, so the convert normalises
it once (`normalize_rows`); a tensor-parallel rank's rows are whole rows, so per-rank is exact.
"""

from __future__ import annotations

from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, Supports

KEY_MAP = {"qkv": "W_pack"}  # over the loader's default (LLaMA) map


SPEC = ArchitectureSpec(
    name="BaichuanForCausalLM",
    hf_architectures=("BaichuanForCausalLM", "BaiChuanForCausalLM"),
    hf_model_types=("baichuan",),
    config_class="bestiary.models.baichuan.model:BaichuanConfig",
    model_class="bestiary.models.baichuan.model:BaichuanForCausalLM",
    from_hf_config="bestiary.models.baichuan.model:from_hf_config",
    key_map=KEY_MAP,
    postprocess={
        "*.attention.qkv.*": "bestiary.core.convert.postprocess:fused_qkv",
        "lm_head.weight": "bestiary.models.baichuan.weights:normalize_rows",
    },
    description="Baichuan 1/2: 7B RoPE, 13B ALiBi, fused W_pack, Baichuan2's NormHead lm_head, RMSNorm, SwiGLU",
    supports=Supports(),  # no LoRA modules declared: no adapter test for this family yet
)


@hookimpl
def bestiary_register_architectures(register) -> None:
    """Register BaichuanForCausalLM."""
    register(SPEC)
