"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM: the conformance kit over prefill + 16 decode steps,
norm_topk_prob and QK-norm shown to matter (switched off in transformers and in bestiary, the logits
miss), and tp 2 and expert-parallel (tp 2 = ep 2) engines equal to tp 1.

Tiny random fp32 models from transformers' own Qwen3MoeConfig; weights re-drawn by parity.reinit_.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bestiary.testing import conformance  # noqa: E402
from bestiary.testing.parity import assert_split_matches, mechanism_miss  # noqa: E402

STEPS = 16
TINY = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
            num_experts_per_tok=2, max_position_embeddings=128)
# window: use_sliding_window; transformers' Qwen3MoeModel puts window 8 (< the 12-token prompt) on every layer.
QWEN3_MOE = {"softmax_topk": TINY, "norm_topk_prob": TINY | dict(norm_topk_prob=True),
             "window_tied": TINY | dict(norm_topk_prob=True, use_sliding_window=True, sliding_window=8,
                                        tie_word_embeddings=True)}
TestQwen3Moe = conformance("Qwen3MoeForCausalLM", QWEN3_MOE, steps=STEPS)


@pytest.fixture(scope="module")
def normed(tmp_path_factory):
    """(reference, source, tp 1 engine) of the norm_topk_prob case."""
    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.engine import Engine
    from bestiary.testing.references import as_reference

    root = tmp_path_factory.mktemp("qwen3_moe")
    reference = as_reference(QWEN3_MOE["norm_topk_prob"])
    source = reference.save(root / "source")
    return reference, source, Engine.load(convert(source, root / "tp1", show_progress=False))


def test_norm_topk_prob_is_exercised(normed):
    """Routing weights renormalised over the top-k (norm_topk_prob) vs the softmax over all experts: turning it
    off in transformers moves its logits by > 100x the bound, and off in bestiary misses transformers by as much."""
    from bestiary.core.layers.moe import MoE

    reference, _, engine = normed
    routers = [layer.mlp.gate for layer in reference.model.model.layers]
    moes = [m for m in engine.model.modules() if isinstance(m, MoE)]
    assert routers and moes and all(m.renormalize for m in moes)

    def flip_hf(on: bool) -> None:
        for r in routers:
            r.norm_topk_prob = on

    def flip_ours(on: bool) -> None:
        for m in moes:
            m.renormalize = on

    bound, hf_moved, ours_moved = mechanism_miss(reference, engine, flip_hf, flip_ours)
    assert hf_moved > 100 * bound and ours_moved > 100 * bound, (bound, hf_moved, ours_moved)


def test_qk_norm_is_exercised(normed):
    """Without the per-head q/k RMSNorms transformers' logits move by > 100x the bound, and ours miss by as much."""
    import torch

    from bestiary.core.layers.self_attention import SelfAttention

    reference, _, engine = normed
    hf_attns = [layer.self_attn for layer in reference.model.model.layers]
    hf_norms = [(a.q_norm, a.k_norm) for a in hf_attns]
    attns = [m for m in engine.model.modules() if isinstance(m, SelfAttention)]
    norms = [(a.q_norm, a.k_norm) for a in attns]

    def flip_hf(on: bool) -> None:
        for a, (q, k) in zip(hf_attns, hf_norms, strict=True):
            a.q_norm, a.k_norm = (q, k) if on else (torch.nn.Identity(), torch.nn.Identity())

    def flip_ours(on: bool) -> None:
        for a, (q, k) in zip(attns, norms, strict=True):
            a.q_norm, a.k_norm = (q, k) if on else (None, None)

    bound, hf_moved, ours_moved = mechanism_miss(reference, engine, flip_hf, flip_ours)
    assert hf_moved > 100 * bound and ours_moved > 100 * bound, (bound, hf_moved, ours_moved)


def test_config_reads_published_names():
    """Published configs name the expert count `num_experts` (transformers' saved ones `num_local_experts`), the
    expert width `moe_intermediate_size`; head_dim absent is hidden / heads (Qwen3MoeAttention's fallback); dense
    layers (mlp_only_layers, decoder_sparse_step > 1) are refused in one line naming the field."""
    from bestiary.core.format.config import Mapping
    from bestiary.core.format.errors import ConfigError
    from bestiary.models.qwen3_moe.model import from_hf_config

    fields = {k: v for k, v in TINY.items() if k != "head_dim"} | dict(num_experts=8, norm_topk_prob=True)
    config = from_hf_config(fields, "float32", Mapping())
    assert (config.num_local_experts, config.intermediate_size, config.head_size, config.norm_topk_prob) == \
        (8, 32, 16, True)
    saved = {k: v for k, v in fields.items() if k != "num_experts"} | dict(num_local_experts=4)
    assert from_hf_config(saved, "float32", Mapping()).num_local_experts == 4
    for field, value in (("mlp_only_layers", [1]), ("decoder_sparse_step", 2)):
        with pytest.raises(ConfigError, match=f"'{field}'"):
            from_hf_config(fields | {field: value}, "float32", Mapping())


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(tp_size=2, moe_ep_size=2)], ids=["tp2", "ep2"])
def test_tp2_and_ep2_engines_equal_tp1(normed, layout, tmp_path):
    """A tp 2 engine (experts split along their FFN dim) and an ep 2 one (two whole experts per rank) match
    transformers over prefill + 16 decode steps within the kit's bound and generate tp 1's greedy tokens."""
    reference, source, engine = normed
    assert_split_matches(reference, source, engine, tmp_path / "split", STEPS, **layout)
