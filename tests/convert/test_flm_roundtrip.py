"""bestiary -> .flm -> bestiary: identical logits (float32 / float16), identical codes (int8 / int4),
for LLaMA and ChatGLM v1 / v2; the export is atomic and never replaces a file that is not a .flm."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import parity
from safetensors.torch import load_file
from tiny_llama import make_tiny_llama

from bestiary.core.cli.main import main
from bestiary.core.convert.export_flm import export_flm
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.config import QuantConfig
from bestiary.core.runtime.engine import Engine

PROMPT = [3, 17, 45, 8, 90, 22, 61, 5]


def logits_of(directory, prompt: list[int]) -> torch.Tensor:
    return parity.EngineRunner(Engine.load(directory)).feed(prompt, all_logits=True)


def round_trip(src, tmp_path, flm_dtype=None, **convert_kwargs):
    """(first checkpoint, checkpoint converted back from the exported .flm)."""
    first, back = tmp_path / "ck", tmp_path / "back"
    convert(src, first, ConvertOptions(**convert_kwargs), show_progress=False)
    flm = export_flm(first, tmp_path / "model.flm", flm_dtype, show_progress=False)
    convert(flm, back, show_progress=False)
    return first, back


def assert_same_codes_and_logits(first, back, exact_logits: bool, prompt: list[int] = PROMPT) -> None:
    a, b = load_file(first / "rank0.safetensors"), load_file(back / "rank0.safetensors")
    assert sorted(a) == sorted(set(b) - {k for k in b if k.endswith(".zeros") and k not in a})
    for key, t in a.items():
        if t.dtype.is_floating_point:
            # scales come back through FastLLM's (max - min) / (2^bits - 1): equal to float32 rounding
            torch.testing.assert_close(b[key].to(t.dtype), t, rtol=2e-7 if exact_logits else 1e-6, atol=0)
        else:
            assert torch.equal(b[key], t), key
    la, lb = logits_of(first, prompt), logits_of(back, prompt)
    if exact_logits:
        assert torch.equal(la, lb)
    else:
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), intermediate_size=128, vocab_size=128)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_float_round_trip_gives_identical_logits(llama_src, tmp_path, dtype):
    first, back = round_trip(llama_src, tmp_path, dtype=dtype)
    assert_same_codes_and_logits(first, back, exact_logits=True)


@pytest.mark.parametrize("quant, flm_dtype", [
    (QuantConfig(quant_algo="W8A16"), None),
    (QuantConfig(quant_algo="W4A16", group_size=128, has_zero_point=True), None),
    (QuantConfig(quant_algo="W4A16", group_size=64, has_zero_point=True), "int4g64"),
    (QuantConfig(quant_algo="W4A16", group_size=32), "int4g32"),  # symmetric: z = 8 written out
])
def test_quantized_round_trip_keeps_the_codes(llama_src, tmp_path, quant, flm_dtype):
    first, back = round_trip(llama_src, tmp_path, flm_dtype, quantization=quant, weight_quantizer="rtn")
    assert_same_codes_and_logits(first, back, exact_logits=False)


def test_int8_zero_points_run_in_every_matmul_path(llama_src, tmp_path):
    """W8A16 with zero points (an asymmetric FastLLM int8 import) equals its dequantized weights."""
    _, back = round_trip(llama_src, tmp_path, quantization=QuantConfig(quant_algo="W8A16"))
    engine = Engine.load(back)
    from bestiary.core.quant.apply import quantized_linears

    layer = next(iter(quantized_linears(engine.model).values()))
    layer.zeros.data.copy_(torch.linspace(-3, 3, layer.zeros.numel()))
    layer.quant.prepare(layer)
    w = layer.quant.dequantize(layer)
    for tokens in (1, 16):  # the GEMV kernel and the dense path
        x = torch.randn(tokens, w.shape[1])
        torch.testing.assert_close(layer.quant.matmul(layer, x, None), x @ w.t(), rtol=2e-2, atol=2e-2)


def test_chatglm_round_trips(tmp_path):
    import test_chatglm as cg

    v1 = cg.write_source(tmp_path / "v1", cg.v1_weights(cg.V1_CONFIG), cg.V1_CONFIG)
    first, back = round_trip(v1, tmp_path / "a")
    assert_same_codes_and_logits(first, back, exact_logits=True, prompt=cg.prompt_of("v1"))
    glm = cg.glm_model(2, seed=1)
    v2 = cg.write_source(tmp_path / "v2", cg.thudm_v2_weights(glm, True), cg.thudm_v2_config(glm.config.to_dict(), True))
    first, back = round_trip(v2, tmp_path / "b", quantization=QuantConfig(quant_algo="W8A16"))
    assert_same_codes_and_logits(first, back, exact_logits=False, prompt=cg.prompt_of("v2"))


def test_export_never_replaces_a_file_that_is_not_flm_and_is_atomic(llama_src, tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    convert(llama_src, ck, show_progress=False)
    other = tmp_path / "notes.flm"
    other.write_text("my notes")
    code = main(["export", "--checkpoint_dir", str(ck), "--output_file", str(other)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "was not written by bestiary" in err and other.read_text() == "my notes"
    assert main(["export", "--checkpoint_dir", str(ck), "--output_file", str(tmp_path / "x.bin")]) == 2
    good = export_flm(ck, tmp_path / "m.flm", show_progress=False)
    before = good.read_bytes()

    from bestiary.core.convert import flm_encode

    calls = {"n": 0}
    real = flm_encode.tensor_parts

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(flm_encode, "tensor_parts", failing)
    with pytest.raises(KeyboardInterrupt):
        export_flm(ck, good, "int8", show_progress=False)
    assert good.read_bytes() == before  # the old file is untouched, no temporary file is left
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_int4_groups_that_would_end_partial_are_split(tmp_path, capsys):
    """K = 96 at g64 would leave a partial last group, which FastLLM's grouped int4 matmul miscomputes
    (docs/fastllm.md): written as int4g32 (gcd), codes unchanged, the same values read back."""
    from bestiary.core.sources.flm_reader import read_flm

    src = make_tiny_llama(tmp_path / "src", hidden_size=96, intermediate_size=128, vocab_size=128)
    quant = QuantConfig(quant_algo="W4A16", group_size=64, has_zero_point=True)
    first, back = round_trip(src, tmp_path, quantization=quant, weight_quantizer="rtn")
    tensors = read_flm(tmp_path / "model.flm").tensors
    assert tensors["model.layers.0.self_attn.q_proj.weight"].group_size == 32  # K = 96
    assert tensors["model.layers.0.mlp.down_proj.weight"].group_size == 64  # K = 128
    assert "written as int4g32" in capsys.readouterr().err
    torch.testing.assert_close(logits_of(back, PROMPT), logits_of(first, PROMPT), rtol=1e-5, atol=1e-5)
