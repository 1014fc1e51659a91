"""OPT against HF transformers' OPTForCausalLM on tiny random-weight models, fp32.

Variants: pre-norm (do_layer_norm_before true, tied lm_head), the 350m shape (post-norm,
word_embed_proj_dim != hidden_size so project_in/out exist, no final norm), and pre-norm
without biases and with an untied lm_head. Each: logits parity over prefill + 8 decode
steps with a broken variant (position offset 0 instead of OPT's 2) that must miss by
100x, greedy generation through the executor, a tp 2 x pp 2 convert that re-assembles to
the tp 1 tensors, and strict-loading errors.
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
from bestiary.core.format.errors import WeightsError  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402
from bestiary.models.opt.model import OPTConfig, from_hf_config  # noqa: E402

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, ffn_dim=48, num_attention_heads=4,
            max_position_embeddings=64)
VARIANTS = {
    "pre_norm": dict(),
    "350m_shape": dict(do_layer_norm_before=False, word_embed_proj_dim=16),
    "no_bias_untied": dict(enable_bias=False, tie_word_embeddings=False),
}
PROMPT = [(7 * i + 3) % VOCAB for i in range(20)]


def _hf_variant(name: str, tmp_path_factory):
    """A tiny random OPTForCausalLM of variant `name` and the dir it is saved in."""
    hf = parity.reinit_(transformers.OPTForCausalLM(transformers.OPTConfig(**BASE, **VARIANTS[name])), seed=1)
    return hf, parity.save_hf(hf, tmp_path_factory.mktemp(f"opt_{name}"))


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    """(name, HF model, HF dir, tp 1 checkpoint dir) of one variant."""
    hf, src = _hf_variant(request.param, tmp_path_factory)
    convert(src, src.parent / "ckpt", show_progress=False)
    return request.param, hf, src, src.parent / "ckpt"


def test_logits_parity_and_broken_offset(case):
    """max |ours - HF| <= tolerance over prefill + 8 decode steps; OPT offset 0 misses by >= 100x."""
    name, hf, _, ckpt = case
    worst, scale = parity.prefill_and_decode_diffs(Engine.load(ckpt), hf, PROMPT)
    tol = parity.tolerance(torch.tensor(scale))
    print(f"OPT {name}: max|diff| {worst:.3e}, tolerance {tol:.3e}, ratio {worst / tol:.4f}")
    assert worst <= tol

    broken = Engine.load(ckpt)
    broken.model.transformer.position_embedding.offset = 0  # the bug: forget OPT's offset of 2
    broken_worst, _ = parity.prefill_and_decode_diffs(broken, hf, PROMPT)
    print(f"OPT {name} with offset 0: max|diff| {broken_worst:.3e} = {broken_worst / tol:.0f}x tolerance")
    assert broken_worst >= 100 * tol


def test_greedy_generation_matches_hf(case):
    """LLM.generate greedy ids == HF generate's, up to HF's first near-tie step."""
    name, hf, _, ckpt = case
    steps = 16
    ref, near_tie = parity.hf_greedy(hf, PROMPT, steps)
    sampling = SamplingConfig(temperature=0, max_new_tokens=steps, ignore_eos=True)
    ours = LLM(ckpt).generate([PROMPT], sampling)[0]
    print(f"OPT {name}: greedy {steps} tokens, first HF near-tie step: {near_tie}")
    assert len(ours.output_ids) == steps
    assert parity.greedy_mismatch(ours.output_ids, ref, near_tie) is None, parity.greedy_mismatch(
        ours.output_ids, ref, near_tie)


TP_DIMS = {**DENSE_TP_DIMS, "transformer.position_embedding.weight": -1,  # learned positions
           "transformer.project_in.weight": -1, "transformer.project_out.weight": -1}  # 350m: replicated


def test_tp2_pp2_shards_reassemble_to_tp1(case, tmp_path):
    """--tp_size 2 --pp_size 2: the 4 rank files re-assemble to exactly the tp 1 tensors."""
    _, _, src, ckpt = case
    convert(src, tmp_path / "tp2pp2", ConvertOptions(tp_size=2, pp_size=2), show_progress=False)
    whole = parity.reassemble_checkpoint(tmp_path / "tp2pp2")
    ref = load_rank_weights(ckpt, 0)
    if "lm_head.weight" not in ref:  # tied at tp 1: lm_head is the embedding itself
        ref["lm_head.weight"] = ref["transformer.vocab_embedding.weight"]
    assert sorted(whole) == sorted(ref)
    assert_split_dims(tmp_path / "tp2pp2", ref, TP_DIMS, tp_size=2)
    for key, tensor in ref.items():
        assert torch.equal(whole[key], tensor), key


def _rewrite_source(src, tmp_path, edit) -> object:
    """A copy of HF dir `src` whose tensors are edited by `edit(dict)`."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "edited"
    out.mkdir(parents=True)
    (out / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_unknown_and_missing_source_keys_fail_with_nearest_names(tmp_path, tmp_path_factory):
    """A source tensor no map consumes, and a target no source fills, name the key and the nearest names."""
    _, src = _hf_variant("pre_norm", tmp_path_factory)
    extra = _rewrite_source(src, tmp_path / "a", lambda t: t.update(
        {"model.decoder.layers.1.self_attn.rotary_emb.inv_freq": torch.zeros(4)}))
    with pytest.raises(WeightsError, match=r"'model\.decoder\.layers\.1\.self_attn\.rotary_emb\.inv_freq' "
                                           r"is not used.*nearest: model\.decoder\.layers\.1\.self_attn\."):
        convert(extra, tmp_path / "a" / "ckpt", show_progress=False)

    def rename(t):
        t["model.decoder.layers.2.fc_1.weight"] = t.pop("model.decoder.layers.2.fc1.weight")

    renamed = _rewrite_source(src, tmp_path / "b", rename)
    with pytest.raises(WeightsError, match=r"'model\.decoder\.layers\.2\.fc1\.weight' .*not found.*"
                                           r"nearest: model\.decoder\.layers\.2\.fc_1\.weight"):
        convert(renamed, tmp_path / "b" / "ckpt", show_progress=False)
    assert not (tmp_path / "b" / "ckpt").exists()


def test_hf_defaults_and_every_field_written(case):
    """Absent HF fields take HF's defaults; config.json has every OPTConfig field."""
    _, _, _, ckpt = case
    written = json.loads((ckpt / "config.json").read_text())
    assert set(written) == set(OPTConfig.model_fields)

    hf = transformers.OPTConfig()
    ours = from_hf_config({"model_type": "opt"}, "float32", Mapping())
    assert (ours.vocab_size, ours.hidden_size, ours.num_hidden_layers, ours.num_attention_heads) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads)
    assert (ours.intermediate_size, ours.max_position_embeddings, ours.hidden_act) == (
        hf.ffn_dim, hf.max_position_embeddings, hf.activation_function)
    assert (ours.do_layer_norm_before, ours.mlp_bias, ours.tie_word_embeddings) == (
        hf.do_layer_norm_before, hf.enable_bias, hf.tie_word_embeddings)
    assert ours.word_embed_proj_dim == hf.word_embed_proj_dim
    assert ours.position_offset == 2
