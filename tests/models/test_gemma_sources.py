"""Gemma 2 / 3 beyond the kit: the configs transformers 4 wrote (Gemma 3's rope_local_base_freq / rope_scaling /
sliding_window_pattern, no layer_types), a single .safetensors file as the source, what the readers refuse (one
line naming the file and the key), and the eager reason `bestiary inspect` shows for the CPU decode plan.
W8A16 / W4A16 engines: test_gemma_quant.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import test_gemma3  # noqa: E402
import torch  # noqa: E402
from cli_errors import one_line  # noqa: E402
from tiny_llama import make_tiny_engine  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import convert  # noqa: E402
from bestiary.core.format.config import Mapping  # noqa: E402
from bestiary.core.format.errors import ConfigError  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.models.gemma2.model import from_hf_config as gemma2_config  # noqa: E402
from bestiary.models.gemma3.model import from_hf_config as gemma3_config  # noqa: E402
from bestiary.testing.parity import EngineRunner, tolerance  # noqa: E402
from bestiary.testing.references import HFReference  # noqa: E402
from bestiary.testing.suite import PROMPT  # noqa: E402

SEQ = PROMPT + [(5 * i + 2) % 96 for i in range(16)]  # 28 tokens, past the window of 4
SIZES = dict(vocab_size=96, hidden_size=64, num_hidden_layers=6, num_attention_heads=4)


def read(reader, **hf):
    return reader(SIZES | hf, "float32", Mapping(), source="src/config.json")


def test_gemma2_reads_hf_defaults_for_absent_fields_and_null_as_off():
    c = read(gemma2_config, hidden_activation="gelu_pytorch_tanh", hidden_act="gelu")
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.sliding_window) == (50.0, 30.0, 4096)
    assert (c.query_pre_attn_scalar, c.head_size, c.tie_word_embeddings) == (256, 256, True)
    assert c.hidden_act == "gelu_pytorch_tanh"  # hidden_activation, which transformers' Gemma reads
    assert c.layer_types == ["sliding_attention", "full_attention"] * 3  # even layers local
    off = read(gemma2_config, attn_logit_softcapping=None, final_logit_softcapping=None)
    assert (off.attn_logit_softcapping, off.final_logit_softcapping) == (None, None)


def test_gemma3_reads_the_transformers4_layout():
    c = read(gemma3_config, rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window=512,
             rope_scaling={"rope_type": "linear", "factor": 8.0})  # gemma-3-4b's fields; pattern 6 by default
    assert (c.rotary_base, c.rotary_local_base, c.rotary_scaling) == (1e6, 1e4, {"rope_type": "linear", "factor": 8.0})
    assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.max_position_embeddings) == (None, None, 131072)


def test_gemma3_reads_the_transformers5_layout():
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 123.0}}
    c = read(gemma3_config, rope_parameters=rope, sliding_window=512, sliding_window_pattern=3)
    assert (c.rotary_base, c.rotary_local_base) == (5e5, 123.0)
    assert c.rotary_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("reader,hf,words", [
    (gemma3_config, {"attn_logit_softcapping": 50.0}, ["'attn_logit_softcapping' = 50.0", "not supported"]),
    (gemma2_config, {"use_bidirectional_attention": True}, ["'use_bidirectional_attention' = True"]),
    (gemma3_config, {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     ["rope_parameters.sliding_attention.rope_type", "'linear'"]),
    (gemma3_config, {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": -1}}},
     ["rope_parameters.full_attention.factor"]),
    (gemma3_config, {"rope_parameters": {"full_attention": 3}}, ["rope_parameters.full_attention"]),
    (gemma2_config, {"attn_logit_softcapping": 0}, ["attn_logit_softcapping"]),
    (gemma3_config, {"sliding_window": None}, ["'sliding_window' is null"]),
])
def test_readers_refuse_in_one_line(reader, hf, words):
    with pytest.raises(ConfigError) as err:
        read(reader, **hf)
    message = str(err.value)
    assert "\n" not in message and "src/config.json" in message, message
    for word in words:
        assert word in message, message


@pytest.fixture(scope="module")
def gemma3_source(tmp_path_factory):
    reference = HFReference(test_gemma3.GEMMA3["pattern2_linear_rope"])
    return reference, reference.save(tmp_path_factory.mktemp("gemma3") / "src"), reference.logits(SEQ)


def test_gemma3_transformers4_config_and_a_single_safetensors_file(gemma3_source, tmp_path):
    """The same weights with the config transformers 4 wrote, converted from the .safetensors file itself."""
    _, src, expected = gemma3_source
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    config = json.loads((src / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key)
    config |= {"rope_theta": 1e6, "rope_local_base_freq": 100.0, "sliding_window_pattern": 2,
               "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    (legacy / "config.json").write_text(json.dumps(config))
    (legacy / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    engine = Engine.load(convert(legacy / "model.safetensors", tmp_path / "ckpt", show_progress=False))
    ours = EngineRunner(engine).feed(SEQ, all_logits=True)
    assert (ours - expected).abs().max().item() <= tolerance(expected)


def test_inspect_shows_why_decode_steps_run_eagerly(gemma3_source, tmp_path, capsys):
    from bestiary.core.cli.main import main

    _, src, _ = gemma3_source
    ckpt = convert(src, tmp_path / "ckpt", show_progress=False)
    assert main(["inspect", str(ckpt)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "decode plan │ eager: an embedding scale (x = embedding * 8" in out, out[-600:]
    engine = make_tiny_engine(tmp_path / "llama") / "engine"
    capsys.readouterr()
    assert main(["inspect", str(engine)]) == 0
    assert "decode plan │ compiled" in " ".join(capsys.readouterr().out.split())


def test_convert_refuses_a_gemma3_attention_softcap_in_one_line(gemma3_source, tmp_path, capsys):
    _, src, _ = gemma3_source
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((src / "config.json").read_text()) | {"attn_logit_softcapping": 50.0}
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    one_line(capsys, ["convert", "--model_dir", str(bad), "--output_dir", str(tmp_path / "out")], 2,
             str(bad), "'attn_logit_softcapping' = 50.0", "not supported")
    assert not (tmp_path / "out").exists()


def test_bf16_embeddings_are_scaled_by_sqrt_hidden_rounded_to_bf16(tmp_path):
    """transformers' Gemma multiplies by sqrt(hidden) as a tensor of the embedding dtype: sqrt(72) = 8.485 is 8.5 in
    bf16. Multiplying by the Python float (DecoderLM.embed before) rounded 283 of the 12 x 72 products otherwise."""
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions

    reference = HFReference(dict(test_gemma3.TINY, hidden_size=72, num_hidden_layers=1))
    hf = reference.model.to(torch.bfloat16)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        expected = hf(ids[None], output_hidden_states=True).hidden_states[0][0]  # [T, 72], the first layer's input
    hf.float()
    engine = Engine.load(convert(reference.save(tmp_path / "src"), tmp_path / "ckpt",
                                 ConvertOptions(dtype="bfloat16"), show_progress=False))
    ours = engine.model.embed(ids, None)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, expected)


def test_bestiary_list_shows_both_families(capsys):
    from bestiary.core.cli.main import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "Gemma2ForCausalLM" in out and "Gemma3ForCausalLM" in out and "gemma3_text" in out
