"""Falcon against HF transformers' FalconForCausalLM on tiny random-weight models, fp32.

Variants: the 7B shape (multi-query, parallel attention, one norm, rotary, no biases), the
40B/180B shape (new decoder architecture: grouped kv heads, ln_attn + ln_mlp, biases), the
RW-1B shape (multi-head, sequential attention/MLP, ALiBi, biases) and a multi-query
parallel model with ALiBi. ALiBi models have 16 heads and prompts past 256 positions,
where HF's bfloat16 ALiBi rounding shows. Each: logits parity over prefill + 8 decode
steps with a broken variant (rotary / ALiBi off) that must miss by 100x, greedy generation
through the executor, a tp 2 x pp 2 convert that re-assembles to the tp 1 tensors (the
single kv head of the multi-query models replicated on both ranks), and strict-loading
errors.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import parity  # noqa: E402
from split_dims import DENSE_TP_DIMS, assert_split_dims  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert  # noqa: E402
from bestiary.core.format.checkpoint import load_rank_weights  # noqa: E402
from bestiary.core.format.config import Mapping  # noqa: E402
from bestiary.core.format.errors import BestiaryError, WeightsError  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.models.falcon.model import FalconConfig, from_hf_config  # noqa: E402

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512)
ALIBI = dict(hidden_size=64, num_attention_heads=16, alibi=True)
VARIANTS = {
    "7b_shape": dict(multi_query=True, parallel_attn=True, bias=False),
    "40b_shape": dict(new_decoder_architecture=True, num_kv_heads=2, bias=True),
    "rw_alibi": dict(multi_query=False, parallel_attn=False, bias=True, **ALIBI),
    "mqa_alibi": dict(multi_query=True, parallel_attn=True, bias=False, **ALIBI),
}


def _prompt(name: str) -> list[int]:
    n = 260 if "alibi" in name else 20
    return [(7 * i + 3) % VOCAB for i in range(n)]


def _hf_variant(name: str, tmp_path_factory):
    """A tiny random FalconForCausalLM of variant `name` and the dir it is saved in."""
    config = transformers.FalconConfig(**{**BASE, **VARIANTS[name]})
    hf = parity.reinit_(transformers.FalconForCausalLM(config), seed=2)
    return hf, parity.save_hf(hf, tmp_path_factory.mktemp(f"falcon_{name}"))


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    """(name, HF model, HF dir, tp 1 checkpoint dir) of one variant."""
    hf, src = _hf_variant(request.param, tmp_path_factory)
    convert(src, src.parent / "ckpt", show_progress=False)
    return request.param, hf, src, src.parent / "ckpt"


def _break(engine: Engine, name: str) -> str:
    """Turn the position information off: ALiBi for the ALiBi variants, rotary for the others."""
    for layer in engine.model.transformer.layers:
        if "alibi" in name:
            layer.attention.attn.key_bias = None
        else:
            layer.attention.rotary = None
    return "alibi off" if "alibi" in name else "rope off"


def test_logits_parity_and_broken_positions(case):
    """max |ours - HF| <= tolerance over prefill + 8 decode steps; without rope/alibi >= 100x."""
    name, hf, _, ckpt = case
    prompt = _prompt(name)
    worst, scale = parity.prefill_and_decode_diffs(Engine.load(ckpt), hf, prompt)
    tol = parity.tolerance(torch.tensor(scale))
    print(f"Falcon {name} ({len(prompt)} prompt tokens): max|diff| {worst:.3e}, tolerance {tol:.3e}, "
          f"ratio {worst / tol:.4f}")
    assert worst <= tol

    broken = Engine.load(ckpt)
    what = _break(broken, name)
    broken_worst, _ = parity.prefill_and_decode_diffs(broken, hf, prompt)
    print(f"Falcon {name} with {what}: max|diff| {broken_worst:.3e} = {broken_worst / tol:.0f}x tolerance")
    assert broken_worst >= 100 * tol


def test_greedy_generation_matches_hf(case):
    """LLM.generate greedy ids == HF generate's, up to HF's first near-tie step."""
    name, hf, _, ckpt = case
    steps, prompt = 12, _prompt(name)
    ref, near_tie = parity.hf_greedy(hf, prompt, steps)
    sampling = SamplingConfig(temperature=0, max_new_tokens=steps, ignore_eos=True)
    ours = LLM(ckpt).generate([prompt], sampling)[0]
    print(f"Falcon {name}: greedy {steps} tokens, first HF near-tie step: {near_tie}")
    assert len(ours.output_ids) == steps
    assert parity.greedy_mismatch(ours.output_ids, ref, near_tie) is None, parity.greedy_mismatch(
        ours.output_ids, ref, near_tie)


TP_DIMS = {**DENSE_TP_DIMS, "transformer.layers.*.mlp_layernorm.weight": -1,  # new decoder: 2 norms
           "transformer.layers.*.mlp_layernorm.bias": -1}


def _check_reassembles(src, ckpt, out, tp_size: int, pp_size: int) -> None:
    convert(src, out, ConvertOptions(tp_size=tp_size, pp_size=pp_size), show_progress=False)
    whole = parity.reassemble_checkpoint(out)
    ref = load_rank_weights(ckpt, 0)
    if "lm_head.weight" not in ref:  # tied at tp 1: lm_head is the embedding itself
        ref["lm_head.weight"] = ref["transformer.vocab_embedding.weight"]
    assert sorted(whole) == sorted(ref)
    assert_split_dims(out, ref, TP_DIMS, tp_size)
    for key, tensor in ref.items():
        assert torch.equal(whole[key], tensor), key


def test_tp2_pp2_shards_reassemble_to_tp1(case, tmp_path):
    """--tp_size 2 --pp_size 2: the 4 rank files re-assemble to exactly the tp 1 tensors."""
    _, _, src, ckpt = case
    _check_reassembles(src, ckpt, tmp_path / "tp2pp2", tp_size=2, pp_size=2)


def test_tp4_replicates_grouped_kv_heads(tmp_path, tmp_path_factory):
    """New decoder architecture, 2 kv groups on 4 ranks: each rank holds its group's k/v."""
    _, src = _hf_variant("40b_shape", tmp_path_factory)
    convert(src, tmp_path / "tp1", show_progress=False)
    _check_reassembles(src, tmp_path / "tp1", tmp_path / "tp4", tp_size=4, pp_size=1)
    rank3 = load_rank_weights(tmp_path / "tp4", 3)["transformer.layers.0.attention.qkv.weight"]
    assert rank3.shape == ((1 + 2) * 8, 32)  # 1 query head + its kv group's k and v, head_dim 8


def test_tp_must_divide_query_heads(tmp_path, tmp_path_factory):
    """tp 3 does not divide 4 query heads: a one-line error before anything is written."""
    _, src = _hf_variant("7b_shape", tmp_path_factory)
    with pytest.raises(BestiaryError, match="tp_size 3 must divide num_attention_heads 4"):
        convert(src, tmp_path / "tp3", ConvertOptions(tp_size=3), show_progress=False)
    assert not (tmp_path / "tp3").exists()


def _rewrite_source(src, out, edit):
    """A copy of HF dir `src` at `out` whose tensors are edited by `edit(dict)`."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    (out / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_unknown_and_missing_source_keys_fail_with_nearest_names(tmp_path, tmp_path_factory):
    """A source tensor no map consumes, and a target no source fills, name the key and the nearest names."""
    _, src = _hf_variant("40b_shape", tmp_path_factory)
    extra = _rewrite_source(src, tmp_path / "a", lambda t: t.update(
        {"transformer.h.0.ln_attn.running_mean": torch.zeros(32)}))
    with pytest.raises(WeightsError, match=r"'transformer\.h\.0\.ln_attn\.running_mean' is not used"
                                           r".*nearest: transformer\.h\.0\.ln_attn\."):
        convert(extra, tmp_path / "a" / "ckpt", show_progress=False)

    def rename(t):
        t["transformer.h.1.ln_mlp2.weight"] = t.pop("transformer.h.1.ln_mlp.weight")

    renamed = _rewrite_source(src, tmp_path / "b", rename)
    with pytest.raises(WeightsError, match=r"'transformer\.h\.1\.ln_mlp\.weight' .*not found.*"
                                           r"nearest: transformer\.h\.1\.ln_mlp2\.weight"):
        convert(renamed, tmp_path / "b" / "ckpt", show_progress=False)
    assert not (tmp_path / "b" / "ckpt").exists()


def test_hf_defaults_and_every_field_written(case):
    """Absent HF fields take HF's defaults (the 7B); config.json has every FalconConfig field."""
    _, _, _, ckpt = case
    written = json.loads((ckpt / "config.json").read_text())
    assert set(written) == set(FalconConfig.model_fields)

    hf = transformers.FalconConfig()
    ours = from_hf_config({"model_type": "falcon"}, "float32", Mapping())
    assert (ours.vocab_size, ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads)
    assert (ours.intermediate_size, ours.norm_epsilon, ours.mlp_bias, ours.new_decoder_architecture) == (
        hf.ffn_hidden_size, hf.layer_norm_epsilon, hf.bias, hf.new_decoder_architecture)
    assert (ours.num_key_value_heads, ours.parallel_attention, ours.position_embedding_type) == (
        1, True, "rope_gpt_neox")


def test_refinedweb_configs():
    """RW configs: RefinedWeb (40B code) is the new decoder with n_head_kv groups, RefinedWebModel the 7B."""
    rw40 = {"model_type": "RefinedWeb", "n_embed": 64, "n_head": 8, "n_head_kv": 2, "n_layer": 2}
    ours = from_hf_config(rw40, "bfloat16", Mapping())
    assert ours.new_decoder_architecture and ours.num_ln_in_parallel_attn == 2
    assert ours.num_key_value_heads == 2
    assert (ours.hidden_size, ours.num_attention_heads, ours.num_hidden_layers) == (64, 8, 2)
    rw7 = {"model_type": "RefinedWebModel", "n_embed": 64, "n_head": 8, "n_layer": 2, "multi_query": True}
    ours = from_hf_config(rw7, "bfloat16", Mapping())
    assert not ours.new_decoder_architecture and ours.num_ln_in_parallel_attn == 1
    assert ours.num_key_value_heads == 1
