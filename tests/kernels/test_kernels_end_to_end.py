"""Every registered architecture, tiny and random, with every op forced onto its Triton kernel
(the interpreter here) gives the logits of the torch path.

The tiny model of an architecture is its own config class filled from `TINY` (hidden 96,
3 heads of 32, 1 kv head where the architecture allows it, FFN 129) plus the variants in
`VARIANTS`; a newly registered architecture is picked up by the parametrization and
needs an entry only if the generic fields do not validate for it.

Two packed sequences go through four steps on a paged cache with block size 5: a packed
prefill (6 and 9 tokens), a mixed step (3 tokens after 6 cached, 1 after 9: prefill
kernel with context), and two batched decode steps.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import MISS

from bestiary.core.format.config import validate_config
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.layers.latent_attention import MultiHeadLatentAttention
from bestiary.core.layers.mlp import MLP, GatedMLP
from bestiary.core.layers.moe import MoE
from bestiary.core.runtime.kv_cache import KVCache
from bestiary.registry import default_registry, resolve

TINY = dict(
    dtype="float32", vocab_size=101, max_position_embeddings=64, hidden_size=96, num_hidden_layers=2,
    num_attention_heads=3, num_key_value_heads=1, head_size=32, intermediate_size=129, norm_epsilon=1e-5,
)
# Per-architecture config fields on top of TINY: one dict per variant tested.
VARIANTS: dict[str, list[dict]] = {
    "OPTForCausalLM": [dict(num_key_value_heads=3)],
    "FalconForCausalLM": [
        dict(),
        dict(position_embedding_type="alibi_with_scale", num_key_value_heads=3, qkv_bias=True, dense_bias=True,
             mlp_bias=True),
    ],
    "ChatGLMForCausalLM": [dict(num_key_value_heads=3, bos_token_id=98, mask_token_id=99, gmask_token_id=100)],
    "MixtralForCausalLM": [dict(num_local_experts=4, num_experts_per_tok=2)],
    # MoE families at their own tiny sizes (their config defaults are 60-256 experts of 1407-5632, minutes in
    # the interpreter): more experts than Mixtral's and odd FFN dims; a dense first layer, shared experts,
    # group-limited routing (V2) and noaux_tc groups (V3), and MLA with a low-rank q at dims that are not
    # powers of two.
    "Qwen2MoeForCausalLM": [dict(num_local_experts=6, num_experts_per_tok=3, shared_expert_intermediate_size=65)],
    "Qwen3MoeForCausalLM": [dict(num_local_experts=6, num_experts_per_tok=3, norm_topk_prob=True)],
    **{arch: [dict(kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=24, q_lora_rank=40,
                   num_local_experts=8, num_experts_per_tok=3, moe_intermediate_size=65, n_shared_experts=1,
                   first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                   **({"topk_method": "group_limited_greedy"} if arch == "DeepseekV2ForCausalLM" else {}))]
       for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")},
}
BLOCK_SIZE = 5
TABLES = [[3, 0, 6, 1], [5, 2, 7, 4]]
PROMPTS = [[5, 17, 42, 3, 8, 61], [11, 7, 90, 33, 2, 64, 27, 1, 50]]
STEPS = [PROMPTS, [[12, 13, 14], [15]], [[16], [17]], [[18], [19]]]
E2E_TOL = 1e-4  # max |triton - torch| <= E2E_TOL * max(1, max |torch|), fp32 end to end


def _cases() -> list:
    return [
        pytest.param(name, fields, id=f"{name}-{i}")
        for name in default_registry().names()
        for i, fields in enumerate(VARIANTS.get(name, [{}]))
    ]


def tiny_model(name: str, fields: dict) -> torch.nn.Module:
    """The architecture's model with TINY + `fields`, random weights, ready for inference."""
    spec = default_registry().get(name)
    config = validate_config(resolve(spec.config_class), {**TINY, **fields, "architecture": name}, f"tiny {name}")
    model = resolve(spec.model_class)(config, 0, device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_((1.0 if "norm" in pname or "ln_f" in pname else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
    model.eval()
    model.prepare_for_inference()
    return model


def _prompts(model) -> list[list[int]]:
    """PROMPTS, with ChatGLM v1's [gMASK] <bos> ending each prompt (its prefix-LM context)."""
    c = model.config
    if hasattr(c, "gmask_token_id"):
        return [p[:-2] + [c.gmask_token_id, c.bos_token_id] for p in PROMPTS]
    return PROMPTS


@torch.inference_mode()
def run_steps(model) -> list[torch.Tensor]:
    """Logits [T, V] of every step of STEPS on a fresh paged cache."""
    kv = KVCache.for_model(model, 8, BLOCK_SIZE)  # the family's pool geometry (a latent cache: one row, no V)
    seqs: list[list[int]] = [[], []]
    out = []
    for step in [_prompts(model), *STEPS[1:]]:
        ctx = [len(s) for s in seqs]
        for s, ids in zip(seqs, step):
            s.extend(ids)
        positions = torch.cat([model.position_ids(s, c0, len(ids)) for s, c0, ids in zip(seqs, ctx, step)], dim=-1)
        prefix = [model.prefix_len(s) for s in seqs] if model.mask_kind != "causal" else None
        meta = AttentionMetadata.build([len(i) for i in step], ctx, TABLES, BLOCK_SIZE, positions=positions,
                                       mask=model.mask_kind, prefix_lens=prefix)
        ids = torch.tensor([t for i in step for t in i])
        out.append(model(ids, meta, kv, all_logits=True).float())
    return out


def _worst(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    return diff, E2E_TOL * max(1.0, max(r.abs().max().item() for r in ref))


@pytest.mark.parametrize("name,fields", _cases())
def test_triton_path_matches_torch_path(name, fields, monkeypatch):
    model = tiny_model(name, fields)
    with dispatch.kernels_mode("torch"):
        ref = run_steps(model)
    used: set[str] = set()
    load = dispatch.family

    def spy(family: str):
        used.add(family)
        return load(family)

    monkeypatch.setattr(dispatch, "family", spy)
    with dispatch.kernels_mode("triton"):
        ours = run_steps(model)
    diff, bound = _worst(ours, ref)
    assert diff <= bound, f"{name} {fields}: max |triton - torch| logits {diff:.3g} > {bound:.3g}"
    assert expected_kernels(model, name) <= used, f"{name}: kernels {sorted(expected_kernels(model, name) - used)} never ran"


def expected_kernels(model, name: str) -> set[str]:
    """The kernel families a model's step must run: norms; attention, unless every layer's is multi-head latent
    attention (its torch path: core.layers.latent_attention); activations where a dense or shared-expert MLP
    runs; moe where the experts fit the fused kernels (not with biases or gpt-oss's clamped SwiGLU); rotary."""
    modules = list(model.modules())
    expected = {"norms"}
    if not any(isinstance(m, MultiHeadLatentAttention) for m in modules):
        expected.add("attention")
    if any(isinstance(m, (GatedMLP, MLP)) for m in modules):
        expected.add("activations")
    moes = [m for m in modules if isinstance(m, MoE)]
    if moes and all(m.kernels_fit for m in moes):
        expected.add("moe")
    if "rope" in model.config.position_embedding_type or "chatglm" in name.lower():
        expected.add("rotary")
    return expected


def test_broken_kernel_misses(monkeypatch):
    """LLaMA with the attention kernel at twice the softmax scale must miss by MISS x the bound."""
    model = tiny_model("LlamaForCausalLM", {})
    with dispatch.kernels_mode("torch"):
        ref = run_steps(model)
    attention = dispatch.family("attention")
    kernel = attention.paged_attention

    def doubled(q, k, v, meta, k_pool, v_pool, scale, *rest):
        return kernel(q, k, v, meta, k_pool, v_pool, 2 * scale, *rest)

    monkeypatch.setattr(attention, "paged_attention", doubled)
    with dispatch.kernels_mode("triton"):
        ours = run_steps(model)
    diff, bound = _worst(ours, ref)
    assert diff >= MISS * bound, f"broken kernel only {diff:.3g} away (bound {bound:.3g})"
