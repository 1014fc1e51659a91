"""core.layers.builder.standard_layer: each layout is the layer class its formula names, with the options
the families use (tests/models/test_family_shape.py checks that every family builds with it)."""

from __future__ import annotations

import pytest

from bestiary.core.format.config import validate_config
from bestiary.core.layers.builder import LAYOUTS, layer_norm, standard_layer
from bestiary.core.layers.decoder_layer import PreNormDecoderLayer
from bestiary.core.layers.mlp import MLP, GatedMLP
from bestiary.core.layers.norm import LayerNorm, RMSNorm
from bestiary.core.layers.output_norm_decoder_layer import OutputNormDecoderLayer
from bestiary.core.layers.parallel_decoder_layer import ParallelDecoderLayer
from bestiary.core.layers.post_norm_decoder_layer import PostNormDecoderLayer
from bestiary.core.layers.sandwich_norm_decoder_layer import SandwichNormDecoderLayer
from bestiary.core.layers.scaled_residual_layer import ScaledResidualLayer
from bestiary.models.llama.model import LlamaConfig, LlamaForCausalLM

CONFIG = dict(architecture="LlamaForCausalLM", dtype="float32", vocab_size=32, hidden_size=16,
              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_size=8, intermediate_size=24,
              max_position_embeddings=32)
CLASSES = {"pre": PreNormDecoderLayer, "post": PostNormDecoderLayer, "parallel": ParallelDecoderLayer,
           "scaled": ScaledResidualLayer, "output": OutputNormDecoderLayer, "sandwich": SandwichNormDecoderLayer}


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(validate_config(LlamaConfig, CONFIG, "tiny"), 0, device="cpu")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_is_its_layer_class(model, layout):
    layer = standard_layer(model, "cpu", layout=layout)
    assert type(layer) is CLASSES[layout]
    norms = [m for m in layer.children() if isinstance(m, RMSNorm)]
    # parallel: the MLP reads the attention's norm; sandwich: a norm before and after each sublayer
    assert len(norms) == {"parallel": 1, "sandwich": 4}.get(layout, 2)


def test_options_reach_the_modules(model):
    layer = standard_layer(model, "cpu", gated=False, rotary=False, qk_norm=True, layout="parallel",
                           parallel_norms=2, norm=layer_norm)
    assert isinstance(layer.mlp, MLP) and not isinstance(layer.mlp, GatedMLP)
    assert layer.attention.rotary is None and isinstance(layer.attention.q_norm, RMSNorm)
    assert isinstance(layer.input_layernorm, LayerNorm) and isinstance(layer.mlp_layernorm, LayerNorm)
    scaled = standard_layer(model, "cpu", layout="scaled", alpha=3.0)
    assert scaled.alpha == 3.0
    assert standard_layer(model, "cpu").attention.rotary is not None


def test_an_unknown_layout_is_refused(model):
    with pytest.raises(ValueError, match="layout 'cake'; expected one of pre, post, parallel, scaled, output, sandwich"):
        standard_layer(model, "cpu", layout="cake")
