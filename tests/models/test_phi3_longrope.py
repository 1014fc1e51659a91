"""LongRoPE (core.layers.longrope) against transformers' Phi3: the conformance kit on the longrope variants of
test_phi3.PHI3; its tables against transformers' own longrope frequencies; each of its pieces (the long / short
switch, the attention scaling) changes transformers' logits, so the parity tests exercise it; the switch is per
sequence; and the KV cache across the switch (transformers' forward with a cache, not its `generate`).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_phi3 import LONGROPE_CASES, PHI3  # noqa: E402

from bestiary.testing import conformance  # noqa: E402
from bestiary.testing.parity import EngineRunner, convert_and_load, greedy_mismatch, hf_greedy, tolerance  # noqa: E402
from bestiary.testing.references import as_reference  # noqa: E402
from bestiary.testing.suite import PROMPT  # noqa: E402

TestPhi3LongRope = conformance("Phi3ForCausalLM", {k: PHI3[k] for k in LONGROPE_CASES}, steps=16)


@pytest.fixture(scope="module")
def long_case(tmp_path_factory):
    """The 128k variant (switch at 8 tokens): its HF reference, our engine and its checkpoint directory."""
    reference = as_reference(PHI3["mini_128k_longrope"])
    tmp = tmp_path_factory.mktemp("phi3_longrope")
    return reference, convert_and_load(reference.save(tmp / "src"), tmp), tmp / "ckpt"


def hf_variant(reference, **scaling_changes) -> torch.nn.Module:
    """transformers' Phi3 with the reference's weights and its longrope dict changed (None: the default rope)."""
    case = {k: v for k, v in PHI3["mini_128k_longrope"].items() if k != "model_type"}
    if scaling_changes.pop("off", False):
        case["rope_scaling"] = None
    else:
        case["rope_scaling"] = case["rope_scaling"] | scaling_changes
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**case))
    model.load_state_dict(reference.model.state_dict())
    return model.eval()


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_tables_are_transformers_longrope_frequencies():
    """Rows below o: transformers' short inv_freq (seq_len <= o), cos / sin times its attention factor; from o on
    and in long_prefix: its long ones (seq_len > o). a = sqrt(1 + ln(256 / 8) / ln 8)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from bestiary.core.layers.longrope import LongRope

    case = {k: v for k, v in PHI3["mini_128k_longrope"].items() if k != "model_type"}
    config = transformers.Phi3Config(**case)
    short, a_short = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=8)
    long, a_long = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=9)
    rope = LongRope.of(16, 10000.0, case["rope_scaling"] | {"original_max_position_embeddings": 8}, 256)
    assert rope is not None and a_short == a_long == pytest.approx(math.sqrt(1 + math.log(32) / math.log(8)))
    assert rope.attention_factor == pytest.approx(a_short)

    def rows(inv_freq, start, stop):
        freqs = torch.outer(torch.arange(start, stop, dtype=torch.float32), inv_freq)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * a_short

    table = rope.table(20)
    torch.testing.assert_close(table[:8], rows(short, 0, 8), rtol=0, atol=1e-6)
    torch.testing.assert_close(table[8:], rows(long, 8, 20), rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.long_prefix(), rows(long, 0, 8), rtol=0, atol=1e-6)
    assert not torch.allclose(rows(short, 0, 8), rows(long, 0, 8))


@pytest.mark.parametrize("variant", ["off", "long_is_short", "no_scaling"])
def test_each_longrope_piece_changes_transformers_logits(long_case, variant):
    """Switched off in transformers (the default rope; long divisors replaced by the short ones, i.e. no switch;
    attention_factor 1), its logits over a prompt past the switch move by > 100x the parity bound, and ours,
    which match the unchanged model, miss the changed one by as much: the kit's parity test exercises each."""
    reference, engine, _ = long_case
    changes = {"off": dict(off=True), "no_scaling": dict(attention_factor=1.0),
               "long_is_short": dict(long_factor=reference.model.config.rope_parameters["short_factor"])}[variant]
    ids = PROMPT + [5, 6, 7, 8]
    ref, changed = logits(reference.model, ids), logits(hf_variant(reference, **changes), ids)
    ours = EngineRunner(engine).feed(ids, all_logits=True)
    bound = tolerance(ref)
    assert (ours - ref).abs().max().item() <= bound
    assert (changed - ref).abs().max().item() > 100 * bound, variant
    assert (ours - changed).abs().max().item() > 100 * bound, variant


def test_short_divisors_matter_below_the_switch(tmp_path):
    """The "longrope_short" variant (switch at 64, prompt + decode 28 tokens): transformers with the short
    divisors replaced by the long ones moves its logits by > 100x the bound, which ours meet unchanged."""
    reference = as_reference(PHI3["longrope_short"])
    engine = convert_and_load(reference.save(tmp_path / "src"), tmp_path)
    case = {k: v for k, v in PHI3["longrope_short"].items() if k != "model_type"}
    scaling = case["rope_scaling"]
    changed = transformers.Phi3ForCausalLM(transformers.Phi3Config(**case | {
        "rope_scaling": scaling | {"short_factor": scaling["long_factor"]}}))
    changed.load_state_dict(reference.model.state_dict())
    ref, moved = logits(reference.model, PROMPT), logits(changed.eval(), PROMPT)
    ours = EngineRunner(engine).feed(PROMPT, all_logits=True)
    assert (ours - ref).abs().max().item() <= tolerance(ref)
    assert (moved - ref).abs().max().item() > 100 * tolerance(ref)


def test_switch_is_per_sequence_in_a_batch(long_case):
    """One step prefills a 4-token prompt (short divisors) beside the 12-token one (long): each row matches
    transformers run on that prompt alone (a switch over the whole batch, as transformers' forward takes
    max(position_ids) of its batch, would give the short one long divisors)."""
    from bestiary.core.kernels.metadata import AttentionMetadata
    from bestiary.core.runtime.kv_cache import KVCache

    reference, engine, _ = long_case
    prompts = [PROMPT[:4], PROMPT]
    kv = KVCache.for_model(engine.model, 4, 16)
    meta = AttentionMetadata.build([4, 12], [0, 0], [[0], [1]], 16)
    with torch.inference_mode():
        ours = engine.model(torch.tensor(prompts[0] + prompts[1]), meta, kv, all_logits=True).float()  # [16, V]
    for rows, prompt in zip(ours.split([4, 12]), prompts):
        ref = logits(reference.model, prompt)
        assert (rows - ref).abs().max().item() <= tolerance(ref), f"{len(prompt)}-token prompt"


def test_generate_across_the_switch_is_transformers_generate(long_case):
    """A 4-token prompt and 16 greedy tokens cross the switch (8): like transformers' `generate`, the executor
    computes the whole sequence again with the long divisors at the first step past 8 (Executor._recomputes),
    so the tokens equal transformers' and every step's logits match its forward over the sequence so far."""
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    reference, _, ckpt = long_case
    prompt = PROMPT[:4]
    expected, tie = hf_greedy(reference.model, prompt, 16)
    llm = LLM(ckpt, num_threads=1)
    try:
        (out,) = llm.generate([prompt], SamplingConfig(max_new_tokens=16, temperature=0.0, ignore_eos=True,
                                                       output_generation_logits=True))
    finally:
        llm.close()
    assert greedy_mismatch(out.output_ids, expected, tie) is None, greedy_mismatch(out.output_ids, expected, tie)
    seq = prompt + out.output_ids
    full = torch.stack([logits(reference.model, seq[:n])[-1] for n in range(len(prompt), len(seq))])  # [16, V]
    assert out.generation_logits is not None
    assert (out.generation_logits.float() - full).abs().max().item() <= tolerance(full)


def test_kv_cache_across_the_switch_is_transformers_forward_with_a_cache(long_case):
    """A 4-token prompt decoded 16 steps crosses the switch (8): the first 8 tokens' K/V stay short-rotated, the
    later tokens use long divisors. That is transformers' forward over a cache, step by step (matched within the
    bound); its `generate` instead recomputes the whole sequence with long divisors once, at the first step past
    8, so its logits from there on (a full forward each step) differ from ours by > 100x the bound."""
    reference, engine, _ = long_case
    cache = transformers.DynamicCache(config=reference.model.config)
    runner, seq = EngineRunner(engine), PROMPT[:4]
    with torch.no_grad():
        ref = reference.model(torch.tensor([seq]), cache=cache, use_cache=True).logits[0]
        ours = runner.feed(seq, all_logits=True)
        worst, scale, after = (ours - ref).abs().max().item(), ref.abs().max().item(), 0.0
        for _ in range(16):
            seq = seq + [int(ref[-1].argmax())]
            ref = reference.model(torch.tensor([seq[-1:]]), cache=cache, use_cache=True,
                                  position_ids=torch.tensor([[len(seq) - 1]])).logits[0]
            ours = runner.feed(seq[-1:])
            worst, scale = max(worst, (ours[0] - ref[-1]).abs().max().item()), max(scale, ref.abs().max().item())
            if len(seq) > 8:
                after = max(after, (ours[0] - logits(reference.model, seq)[-1]).abs().max().item())
    assert worst <= 1e-4 * max(1.0, scale), f"max|ours - HF cached forward| {worst:.3e}"
    assert after > 100 * 1e-4 * max(1.0, scale), "generate's recompute past the switch no longer differs: update docs"


def test_prefix_blocks_are_not_reused_across_the_switch(tmp_path):
    """A 72-token prompt (long divisors: switch at 64) whose first 32-token block a 40-token one (short) computed
    before: reusing that block's short-rotated K/V gave other logits than the prompt alone (block reuse is off for
    LongRoPE models: core.runtime.executor.supports_block_reuse). Both runs match transformers."""
    from bestiary.core.convert.source_to_checkpoint import convert
    from bestiary.core.runtime.llm import LLM
    from bestiary.core.runtime.sampling import SamplingConfig

    reference = as_reference(PHI3["longrope_short"])
    ckpt = convert(reference.save(tmp_path / "src"), tmp_path / "ckpt", show_progress=False)
    short = [3 + i % 90 for i in range(40)]  # with 2 new tokens, 42 <= 64
    long = short[:32] + [5 + (7 * i) % 90 for i in range(40)]  # 72 > 64; tokens 0-31: short's first block
    sampling = SamplingConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True, output_generation_logits=True)
    ref = logits(reference.model, long)[-1]
    for warm in (False, True):
        llm = LLM(ckpt, num_threads=1)
        try:
            if warm:
                llm.generate([short], sampling)
            (out,) = llm.generate([long], sampling)
        finally:
            llm.close()
        assert out.generation_logits is not None
        diff = (out.generation_logits[0].float() - ref).abs().max().item()
        assert diff <= tolerance(ref), f"after a short prompt sharing its first block: {warm}; max|diff| {diff:.3e}"
