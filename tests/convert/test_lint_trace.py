"""The linter names what no transpose explains (core.convert.lint_trace): the first layer and sub-module
that departs from the transformers reference, and the config field whose usual mistake explains it.
Two mistakes an outside contributor made, planted in a built-in family's reader: a wrong rotary fraction,
and a same-named HF field not copied."""

from __future__ import annotations

import dataclasses

import parity
import pytest
import torch

from bestiary.core.convert.lint import lint
from bestiary.core.format.hf_config import hf_config_reader
from bestiary.models.chatglm.model import from_hf_config_v2
from bestiary.models.gpt2.model import GPT2Config
from bestiary.registry import Registry

transformers = pytest.importorskip("transformers")
TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4)  # layer 2 is judged by the logits


def full_rotary(hf, dtype, mapping, source="config.json"):
    """GLM's reader with the rotary fraction forgotten (1.0 instead of the source's 0.5)."""
    return from_hf_config_v2(hf, dtype, mapping, source).model_copy(update={"rotary_pct": 1.0})


# GPT-2's reader that copies no same-named field: scale_attn_by_inverse_layer_idx stays False.
gpt2_without_copies = hf_config_reader(
    GPT2Config, defaults={"norm_epsilon": 1e-5, "hidden_act": "gelu_new", "max_position_embeddings": 1024,
                          "tie_word_embeddings": True},
    copy_same_named=False, qkv_bias=True, dense_bias=True, mlp_bias=True)


def planted(architecture: str, reader: str) -> Registry:
    registry = Registry.from_plugins()
    registry.specs[architecture] = dataclasses.replace(registry.specs[architecture], from_hf_config=reader)
    return registry


def test_a_wrong_rotary_fraction_is_named_with_its_layer(tmp_path):
    torch.manual_seed(0)
    hf = transformers.GlmForCausalLM(transformers.GlmConfig(**TINY, intermediate_size=80, num_key_value_heads=2,
                                                            head_dim=16, partial_rotary_factor=0.5,
                                                            pad_token_id=0))
    source = parity.save_hf(parity.reinit_(hf, 0), tmp_path)
    assert lint(source).suspicious == []  # the built-in reader
    report = lint(source, registry=planted("ChatGLM2ForCausalLM", "test_lint_trace:full_rotary"))
    assert report.suspicious == [
        "config rotary_pct: 1.0? with 0.5, layer 0 (attention) matches the GlmForCausalLM reference"]


def test_a_same_named_field_read_otherwise_is_named(tmp_path):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=3, n_head=4, n_positions=128, scale_attn_by_inverse_layer_idx=True))
    source = parity.save_hf(parity.reinit_(hf, 0), tmp_path)
    assert lint(source).suspicious == []
    report = lint(source, registry=planted("GPT2LMHeadModel", "test_lint_trace:gpt2_without_copies"))
    assert report.suspicious == [
        "config scale_attn_by_inverse_layer_idx: the config has False but the source's config.json says True "
        "(a reader that drops or overrides it?)",
        "config scale_attn_by_inverse_layer_idx: False? with True, layer 1 (attention) matches the "
        "GPT2LMHeadModel reference"]


def test_an_unexplained_miss_is_placed_at_its_layer_and_part(tmp_path):
    """A corrupted MLP tensor (not square, not a config field): the report says where it starts."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, intermediate_size=80,
                                                                max_position_embeddings=128))
    source = parity.save_hf(parity.reinit_(hf, 0), tmp_path)
    registry = Registry.from_plugins()
    spec = registry.specs["LlamaForCausalLM"]
    registry.specs[spec.name] = dataclasses.replace(
        spec, postprocess={**spec.postprocess, "transformer.layers.1.mlp.proj.weight": "test_lint_trace:negate"})
    (line,) = lint(source, registry=registry).suspicious
    assert line.startswith("logits: differ from the LlamaForCausalLM reference by ")
    assert line.endswith(", first at layer 1 (mlp (attention matches)) (not explained by transposed square "
                         "tensors or the usual config mistakes)")


def negate(key, tensors, config):
    """A planted conversion bug: the tensor's sign flipped."""
    (t,) = tensors
    return {key: -t}
