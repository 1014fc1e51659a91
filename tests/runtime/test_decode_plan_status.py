"""DecoderLM.decode_plan_status(): the right answer before the first decode step, and a reason that names
what in a layer blocks the compiled CPU plan (not only the layer's class)."""

from __future__ import annotations

import parity
import pytest
import transformers

from bestiary.core.convert.source_to_checkpoint import convert
from bestiary.core.kernels.cpu.build import library
from bestiary.core.runtime.engine import Engine
from bestiary.testing.parity import EngineRunner

TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)


def engine_of(tmp_path, hf_model) -> Engine:
    parity.reinit_(hf_model, 0).save_pretrained(tmp_path / "hf")
    return Engine.load(convert(tmp_path / "hf", tmp_path / "ckpt", show_progress=False))


@pytest.mark.parametrize("kind,expected", [
    ("falcon", "layer 0: the parallel attention + MLP layout (ParallelDecoderLayer; the plan runs pre-norm layers)"),
    ("mixtral", "layer 0: MoE feed-forward block (the plan runs a gated MLP"),
    ("exaone4", "layer 0: the output-norm layout (OutputNormDecoderLayer"),
])
def test_a_refusal_is_known_before_any_step_and_names_the_cause(tmp_path, kind, expected):
    if kind == "falcon":
        hf = transformers.FalconForCausalLM(transformers.FalconConfig(**TINY, new_decoder_architecture=False))
    elif kind == "mixtral":
        hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY, intermediate_size=80,
                                                                         num_local_experts=4, num_key_value_heads=2))
    else:
        hf = transformers.Exaone4ForCausalLM(transformers.Exaone4Config(**TINY, intermediate_size=80,
                                                                         num_key_value_heads=2))
    engine = engine_of(tmp_path, hf)
    assert (engine.model.decode_plan_status() or "").startswith(expected), engine.model.decode_plan_status()


@pytest.mark.skipif(library() is None, reason="the CPU kernels are not built here")
def test_a_model_the_plan_runs_says_so_before_and_after_decoding(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, intermediate_size=80))
    engine = engine_of(tmp_path, hf)
    assert engine.model.decode_plan_status() is None
    runner = EngineRunner(engine)
    runner.feed([1, 2, 3])
    runner.feed([4])  # a decode step: the plan is built and runs
    assert engine.model.decode_plan_status() is None
    assert any(p is not None for p in engine.model.__dict__["_decode_plans"].values())
