"""Each mechanism Gemma 2 / 3 added to the core is exercised by their parity tests (test_gemma2.py,
test_gemma3.py): switched off in the transformers reference, it moves the logits over a 28-token sequence (past
the window of 4) by more than 100x the parity bound, while the engine stays within the bound of the reference with
it on. Where transformers cannot switch one off (Gemma 2's embedding scale, computed inline), ours is broken
instead and misses by 100x."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

pytest.importorskip("transformers")

import test_gemma2  # noqa: E402
import test_gemma3  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.layers.norm import RMSNorm  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.testing.parity import EngineRunner, tolerance  # noqa: E402
from bestiary.testing.references import HFReference  # noqa: E402
from bestiary.testing.suite import PROMPT  # noqa: E402

SEQ = PROMPT + [(7 * i + 5) % 96 for i in range(16)]  # 28 tokens: the window of 4 slides 24 times


def attns(model) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def no_attention_cap(model) -> None:
    for a in attns(model):
        a.attn_logit_softcapping = None


def no_final_cap(model) -> None:
    model.config.final_logit_softcapping = None


def no_window(model) -> None:
    model.config.sliding_window = 4096  # the masks read the config: wider than the sequence
    for a in attns(model):
        a.sliding_window = None


def head_dim_scale(model) -> None:
    for a in attns(model):
        a.scaling = a.head_dim**-0.5  # 1/sqrt(D) instead of 1/sqrt(query_pre_attn_scalar)


def plain_w_norms(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)  # HF computes x * (1 + w): with w - 1 stored, that is x * w (no offset)


def no_post_norms(model) -> None:
    for layer in model.model.layers:
        layer.post_attention_layernorm = nn.Identity()
        layer.post_feedforward_layernorm = nn.Identity()


def no_qk_norm(model) -> None:
    for a in attns(model):
        a.q_norm, a.k_norm = nn.Identity(), nn.Identity()


def local_rope_global_theta(model) -> None:
    rope = model.model.rotary_emb
    d = rope.sliding_attention_inv_freq.numel() * 2
    rope.sliding_attention_inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))  # theta 10^6, not 100


def unscaled_global_rope(model) -> None:
    model.model.rotary_emb.full_attention_inv_freq *= 4.0  # undo linear factor 4


def unscaled_embedding(model) -> None:
    model.model.embed_tokens.embed_scale.fill_(1.0)


SWITCHES: dict[str, tuple[str, Callable[[nn.Module], None]]] = {
    "gemma2-attention-softcap": ("gemma2", no_attention_cap),
    "gemma2-final-softcap": ("gemma2", no_final_cap),
    "gemma2-window": ("gemma2", no_window),
    "gemma2-query_pre_attn_scalar": ("gemma2", head_dim_scale),
    "gemma2-norm-1+w": ("gemma2", plain_w_norms),
    "gemma2-post-norms": ("gemma2", no_post_norms),
    "gemma3-qk-norm": ("gemma3", no_qk_norm),
    "gemma3-local-rope-base": ("gemma3", local_rope_global_theta),
    "gemma3-global-rope-scaling": ("gemma3", unscaled_global_rope),
    "gemma3-window": ("gemma3", no_window),
    "gemma3-embedding-scale": ("gemma3", unscaled_embedding),
    "gemma3-final-softcap": ("gemma3_cap", no_final_cap),
    "gemma3-norm-1+w": ("gemma3", plain_w_norms),
}
CASES = {"gemma2": test_gemma2.GEMMA2["window_softcaps"], "gemma3": test_gemma3.GEMMA3["pattern2_linear_rope"],
         "gemma3_cap": test_gemma3.GEMMA3["pattern3_final_cap_untied"]}


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, tuple[Engine, torch.Tensor]]:
    """case -> (its engine, the reference's logits over SEQ [28, V]); the engine's checkpoint is engine.directory."""
    out = {}
    for name, config in CASES.items():
        reference = HFReference(config)
        src = reference.save(tmp_path_factory.mktemp(name) / "src")
        engine = Engine.load(convert(src, src.parent / "ckpt", show_progress=False))
        out[name] = (engine, reference.logits(SEQ))
    return out


def test_chunked_prefill_reads_the_capped_window_from_the_pool(engines):
    """Prompt chunks after the first attend over cached keys (capped_attention gathers them through the window)."""
    engine, reference = engines["gemma2"]
    runner = EngineRunner(engine)
    ours = torch.cat([runner.feed(SEQ[a:b], all_logits=True) for a, b in ((0, 10), (10, 19), (19, 28))])
    assert (ours - reference).abs().max().item() <= tolerance(reference)


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_a_batch_generates_what_each_prompt_does_alone(case, engines):
    """Batched decode steps of sequences of different lengths (per-sequence windows and caps) change nothing."""
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    engine, _ = engines[case]
    llm = LLM(engine.directory)
    greedy = SamplingConfig(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [SEQ[:3], SEQ[:12], SEQ[5:20]]
    together = [c.output_ids for c in llm.generate(prompts, greedy)]
    assert together == [llm.generate([p], greedy)[0].output_ids for p in prompts]


def test_int8_kv_cache_runs_the_cap_on_dequantized_pools(engines, tmp_path):
    """An INT8 KV cache: the soft-capped attention reads the pools dequantized (never the compiled codes path)."""
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions
    from bestiary.core.format.config import QuantConfig

    engine, reference = engines["gemma2"]
    source = engine.directory.parent / "src"
    options = ConvertOptions(quantization=QuantConfig(kv_cache_quant_algo="INT8"))
    runner = EngineRunner(Engine.load(convert(source, tmp_path / "int8kv", options, show_progress=False)))
    ours = torch.cat([runner.feed(SEQ[:20], all_logits=True)] + [runner.feed([t]) for t in SEQ[20:]])
    cos = torch.nn.functional.cosine_similarity(ours.flatten(), reference.flatten(), dim=0).item()
    assert torch.isfinite(ours).all() and cos > 0.999, cos


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_switching_a_mechanism_off_in_transformers_moves_the_logits(switch, engines):
    case, off = SWITCHES[switch]
    engine, reference = engines[case]
    ours = EngineRunner(engine).feed(SEQ, all_logits=True)  # prefill over 28 tokens: the window slides
    bound = tolerance(reference)
    assert (ours - reference).abs().max().item() <= bound  # the engine runs the mechanism
    switched = HFReference(CASES[case])
    off(switched.model)
    moved = (switched.logits(SEQ) - reference).abs().max().item()
    assert moved > 100 * bound, f"{switch}: switched off, transformers' logits move only {moved:.2e}"


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
@pytest.mark.parametrize("broken", ["embedding_scale", "norm_offset"])
def test_ours_without_the_mechanism_misses(case, broken, engines):
    """Gemma 2's sqrt(hidden) embedding scale cannot be switched off in transformers: ours is, and misses."""
    engine, reference = engines[case]
    model = engine.model
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    try:
        if broken == "embedding_scale":
            model.embedding_scale = None
        else:
            for m in norms:
                m.offset = 0.0
        ours = EngineRunner(engine).feed(SEQ, all_logits=True)
    finally:
        model.embedding_scale = math.sqrt(model.config.hidden_size)
        for m in norms:
            m.offset = 1.0
    assert (ours - reference).abs().max().item() > 100 * tolerance(reference)
