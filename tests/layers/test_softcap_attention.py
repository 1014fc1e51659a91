"""The attention-logit soft-cap (Gemma 2) and what else Gemma added to the core layers, checked directly:
capped_attention is the formula over the paged cache (prefill, chunked prefill, batched decode, windows, ALiBi,
GQA); standard_layer's new options reach the modules; the CPU decode plan and CUDA graphs refuse what they lack."""

from __future__ import annotations

import math

import pytest
import torch

from bestiary.core.format.config import validate_config
from bestiary.core.kernels import dispatch
from bestiary.core.kernels.attention_ref import write_kv
from bestiary.core.kernels.metadata import AttentionMetadata
from bestiary.core.layers.attention import PagedAttention
from bestiary.core.layers.builder import standard_layer
from bestiary.core.layers.norm import RMSNorm
from bestiary.core.layers.rotary import Rotary
from bestiary.core.runtime import cpu_plan, cuda_graph
from bestiary.models.llama.model import LlamaConfig, LlamaForCausalLM

H, KVH, D, BS = 4, 2, 8, 4
CAP, SCALE = 1.5, 0.6


def reference(q, k, v, q_pos, window, slopes):
    """softmax(c tanh(scale q k^T / c) + alibi, masked causal / window) v for one sequence: q [n, H, D],
    k / v [L, KVH, D], q_pos [n] -> [n, H * D]."""
    g = H // KVH
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [L, H, D]
    s = torch.einsum("nhd,lhd->hnl", q, kk) * SCALE
    s = CAP * torch.tanh(s / CAP)
    j, i = torch.arange(k.shape[0])[None, :], q_pos[:, None]
    if slopes is not None:
        s = s + slopes[:, None, None] * (j - i)[None]
    visible = (j <= i) & ((window == 0) | (i - j < window))
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), vv).reshape(q.shape[0], -1)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("alibi", [False, True])
def test_capped_attention_is_the_formula_over_the_paged_cache(window, alibi):
    gen = torch.Generator().manual_seed(0)
    lens, tables = [9, 6], [[3, 0, 5], [1, 4]]  # blocks not in order
    k_all = [torch.randn(n + 2, KVH, D, generator=gen) * 2 for n in lens]  # 2 decode steps follow the prompt
    v_all = [torch.randn(n + 2, KVH, D, generator=gen) for n in lens]
    q_all = [torch.randn(n + 2, H, D, generator=gen) * 2 for n in lens]
    pools = torch.zeros(2, 8, BS, KVH, D)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    # chunks: the prompts in two prefill chunks each (the second reads the pool), then two batched decode steps
    steps = [([5, 4], [0, 0]), ([4, 2], [5, 4]), ([1, 1], [9, 6]), ([1, 1], [10, 7])]
    for seq_lens, ctx in steps:
        meta = AttentionMetadata.build(seq_lens, ctx, tables, BS)
        pick = [slice(c, c + n) for c, n in zip(ctx, seq_lens)]
        q = torch.cat([q_all[b][pick[b]] for b in range(2)])
        k, v = torch.cat([k_all[b][pick[b]] for b in range(2)]), torch.cat([v_all[b][pick[b]] for b in range(2)])
        write_kv(pools[0], pools[1], k, v, meta.slot_mapping)
        out = dispatch.paged_attention(q, k, v, meta, pools[0], pools[1], SCALE, slopes, window=window, softcap=CAP)
        expected = torch.cat([reference(q_all[b][pick[b]], k_all[b][: ctx[b] + seq_lens[b]],
                                        v_all[b][: ctx[b] + seq_lens[b]], torch.arange(ctx[b], ctx[b] + seq_lens[b]),
                                        window, slopes) for b in range(2)])
        assert torch.allclose(out, expected, atol=1e-5), (seq_lens, ctx, (out - expected).abs().max())
        uncapped = dispatch.paged_attention(q, k, v, meta, pools[0], pools[1], SCALE, slopes, window=window)
        assert (uncapped - expected).abs().max() > 1e-2  # the cap bites on these scores


@pytest.fixture(scope="module")
def llama():
    config = dict(architecture="LlamaForCausalLM", dtype="float32", vocab_size=64, hidden_size=16,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_size=8, intermediate_size=24,
                  max_position_embeddings=32)
    return LlamaForCausalLM(validate_config(LlamaConfig, config, "tiny"), 0, device="cpu")


def test_standard_layer_options_reach_the_modules(llama):
    rope = Rotary(8, 8, 123.0, None, 32)
    layer = standard_layer(llama, "cpu", layout="sandwich", softcap=2.5, rotary=rope, scale=0.3,
                           qk_norm=lambda d: RMSNorm(d, 1e-6, offset=1.0))
    att = layer.attention
    assert att.attn.softcap == 2.5 and att.attn.scale == 0.3 and att.rotary is rope
    assert att.q_norm.offset == 1.0 and att.k_norm.offset == 1.0
    with pytest.raises(ValueError, match="softcap and a family's own attn op"):
        standard_layer(llama, "cpu", softcap=2.5, attn=PagedAttention(8))


def test_offset_rms_norm_scales_by_one_plus_w():
    norm = RMSNorm(4, 1e-6, torch.bfloat16, offset=1.0)
    norm.weight.data = torch.tensor([0.0, 0.5, -0.25, 0.001], dtype=torch.bfloat16)
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    xf = x.float()
    expected = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.float())).bfloat16()
    assert torch.equal(norm(x), expected)  # x / rms(x) * (1 + w) in float32, rounded once
    y, h = norm.add_and_norm(x, x)
    assert torch.equal(h, 2 * x) and torch.equal(y, norm(2 * x))


def test_plan_and_graphs_refuse_what_they_lack(llama):
    layer = llama.transformer.layers[0]
    assert cpu_plan.refusal(llama) is None
    llama.logit_softcap = 30.0
    assert cpu_plan.refusal(llama) == "a final-logit soft-cap (the plan's lm_head has none)"
    llama.logit_softcap = None
    llama.transformer.ln_f.offset = 1.0
    assert cpu_plan.refusal(llama) == "RMSNorm with a (offset + w) scale (the plan's norm multiplies by w)"
    llama.transformer.ln_f.offset = 0.0
    llama.embedding_scale = math.sqrt(16)
    assert cpu_plan.refusal(llama) == "an embedding scale (x = embedding * 4; the plan's embedding has none)"
    llama.embedding_scale = None
    layer.attention.attn.softcap = 50.0
    try:
        assert cpu_plan.layer_refusal(layer) == "an attention logit soft-cap (the plan's attention has none)"
        llama.__dict__.pop("cuda_graph_refusal", None)
        assert "soft-cap" in cuda_graph.model_refusal(llama)
    finally:
        layer.attention.attn.softcap = None
        llama.__dict__.pop("cuda_graph_refusal", None)
