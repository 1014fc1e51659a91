"""End-to-end scale tuning after GPTQ (core.convert.tune): the distillation loss against a hand-written
KL, the parametrization against packing's dequantization, tuning on a tiny LLaMA (loss down,
codes fixed, every layer reached), and the convert flag."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

pytest.importorskip("transformers")

from test_quant_gptq import _float_model
from tiny_llama import make_tiny_llama

from bestiary.core.convert.calibration import calibration_chunks, chunk_logits
from bestiary.core.convert.quantize_calibrated import check_tune_steps, load_tensors, weight_calibration_ids
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.convert.tune import (
    DEFAULT_STEPS,
    GroupScaled,
    TeacherTargets,
    distillation_loss,
    tune_group_scales,
)
from bestiary.core.format import packing
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import ConfigError
from bestiary.core.format.packing import Int4Codes


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tune"), intermediate_size=128)


# --- the loss ------------------------------------------------------------------------------------
def test_distillation_loss_is_the_kl_over_the_top_k_and_the_rest():
    gen = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(6, 40, generator=gen) * 3, torch.randn(6, 40, generator=gen) * 3
    full = TeacherTargets.from_logits(teacher, top_k=40)  # every token kept: the plain KL
    kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
    assert float(distillation_loss(student, full)) == pytest.approx(float(kl), rel=1e-4, abs=1e-6)
    # top 3 + rest, by hand for every token
    p, q = F.softmax(teacher, -1), F.softmax(student, -1)
    top = p.topk(3, dim=-1).indices
    hand = 0.0
    for t in range(6):
        pk, qk = p[t, top[t]], q[t, top[t]]
        pr, qr = 1 - pk.sum(), 1 - qk.sum()
        hand += float((pk * (pk / qk).log()).sum() + pr * (pr / qr).log())
    assert float(distillation_loss(student, TeacherTargets.from_logits(teacher, top_k=3))) == pytest.approx(
        hand / 6, rel=1e-4)
    assert float(distillation_loss(teacher, TeacherTargets.from_logits(teacher, top_k=3))) == pytest.approx(0, abs=1e-6)


# --- the parametrization -------------------------------------------------------------------------
@pytest.mark.parametrize("zero", [False, True])
def test_group_scaled_starts_at_the_dequantized_weight(zero):
    w = torch.randn(24, 80, generator=torch.Generator().manual_seed(1))  # 80 = 2 groups of 32 + 16
    codes, s, z = packing.quantize_int4_groupwise(w, 32, zero)
    layer = GroupScaled(Int4Codes(codes, s, z, 32), torch.float32)
    assert torch.equal(layer(w), packing.dequantize_int4(codes, s, z, 32))
    assert (layer.z is None) == (not zero)
    with torch.no_grad():
        layer.u.add_(0.1)
    tuned = layer.tuned()
    assert torch.equal(tuned.codes, codes) and torch.allclose(tuned.s, s * torch.exp(torch.tensor(0.1)))
    assert torch.allclose(layer(w), packing.dequantize_int4(codes, tuned.s, tuned.z, 32))


@pytest.mark.parametrize("zero", [False, True])
def test_group_scaled_gradients_are_the_dequantize_formulas(zero):
    """The per-group broadcast (q - z) * s0 exp(u) has the gradients of packing.dequantize_int4's [N, K]
    form in u and z (80 features: a short last group)."""
    g = torch.Generator().manual_seed(2)
    w, r = torch.randn(24, 80, generator=g), torch.randn(24, 80, generator=g)
    codes, s, z = packing.quantize_int4_groupwise(w, 32, zero)
    layer = GroupScaled(Int4Codes(codes, s, z, 32), torch.float32)
    with torch.no_grad():
        layer.u.copy_(0.05 * torch.randn(layer.u.shape, generator=g))
    (layer(w) * r).sum().backward()
    u = layer.u.detach().clone().requires_grad_()
    z_ref = None if z is None else layer.z.detach().clone().requires_grad_()
    (packing.dequantize_int4(codes, s.float() * u.exp(), z_ref, 32) * r).sum().backward()
    torch.testing.assert_close(layer.u.grad, u.grad, rtol=1e-5, atol=1e-6)
    if zero:
        torch.testing.assert_close(layer.z.grad, z_ref.grad, rtol=1e-5, atol=1e-6)


# --- tuning a model ------------------------------------------------------------------------------
def test_tuning_lowers_the_loss_keeps_the_codes_and_reaches_every_layer(tiny_src, tmp_path):
    model, names, tensors, config = _float_model(tiny_src, tmp_path)
    ids = torch.randint(0, config.vocab_size, (192,), generator=torch.Generator().manual_seed(0)).tolist()
    chunks = calibration_chunks(model, ids, 96)
    with torch.inference_mode():  # as recorded by the calibration pass
        targets = [TeacherTargets.from_logits(chunk_logits(model, c)) for c in chunks]
    layers = {}
    for key, name in names.items():
        codes, s, z = packing.quantize_int4_groupwise(tensors[key], 32, True)
        layers[name] = Int4Codes(codes, s, z, 32)
        tensors[key] = packing.dequantize_int4(codes, s, z, 32)
    load_tensors(model, tensors, set(names))

    def loss() -> float:
        with torch.no_grad():
            return sum(float(distillation_loss(chunk_logits(model, c), t)) for c, t in zip(chunks, targets))

    before = loss()
    losses = []
    tuned = tune_group_scales(model, layers, chunks, targets, steps=30, lr=1e-2, on_step=losses.append)
    after = loss()  # the model is left holding the tuned weights
    assert len(losses) == 30 and after < 0.7 * before
    assert set(tuned) == set(layers)
    for name, layer in tuned.items():
        assert torch.equal(layer.codes, layers[name].codes)
        assert not torch.equal(layer.s, layers[name].s), name  # the gradient reached every layer
        assert not torch.equal(layer.z, layers[name].z), name
        key = next(k for k, n in names.items() if n == name)
        weight = dict(model.named_parameters())[key]
        assert torch.allclose(weight, packing.dequantize_int4(layer.codes, layer.s, layer.z, 32), atol=1e-6)


def test_convert_tunes_scales_and_keeps_gptq_codes(tiny_src, tmp_path):
    quant = QuantConfig(quant_algo="W4A16", group_size=32, has_zero_point=True)
    convert(tiny_src, tmp_path / "gptq", ConvertOptions(quantization=quant, tune_steps=0), show_progress=False)
    convert(tiny_src, tmp_path / "tuned", ConvertOptions(quantization=quant, tune_steps=8), show_progress=False)
    plain, tuned = (load_file(str(tmp_path / d / "rank0.safetensors")) for d in ("gptq", "tuned"))
    assert plain.keys() == tuned.keys()
    key = "transformer.layers.1.attention.qkv"
    assert torch.equal(plain[f"{key}.weight"], tuned[f"{key}.weight"])  # the same GPTQ codes
    assert not torch.equal(plain[f"{key}.weights_scaling_factor"], tuned[f"{key}.weights_scaling_factor"])
    assert not torch.equal(plain[f"{key}.zeros"], tuned[f"{key}.zeros"])

    # on its calibration tokens, the tuned checkpoint is closer to the float model
    from bestiary.core.runtime.engine import Engine

    ref = Engine.load(convert(tiny_src, tmp_path / "f", show_progress=False)).model
    ids = weight_calibration_ids(None, ref.config.vocab_size, None)[:256]

    def kl(directory) -> float:
        model = Engine.load(directory).model
        with torch.inference_mode():
            target = TeacherTargets.from_logits(chunk_logits(ref, ids), top_k=ref.config.vocab_size)
            return float(distillation_loss(chunk_logits(model, ids), target))

    assert kl(tmp_path / "tuned") < kl(tmp_path / "gptq")


# --- every architecture --------------------------------------------------------------------------
def _source(arch: str, directory):
    """A tiny random HF-format source of `arch` (the builders of the parity tests)."""
    import parity
    import test_chatglm
    import test_falcon
    import test_mixtral
    import test_opt
    import transformers

    if arch == "opt":
        hf = transformers.OPTForCausalLM(transformers.OPTConfig(**test_opt.BASE))
    elif arch.startswith("falcon"):
        variant = "rw_alibi" if arch == "falcon_alibi" else "7b_shape"
        hf = transformers.FalconForCausalLM(transformers.FalconConfig(**{**test_falcon.BASE, **test_falcon.VARIANTS[variant]}))
    elif arch == "mixtral":
        hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**test_mixtral.HF_CONFIG))
    elif arch == "glm":
        hf = test_chatglm.glm_model(kv_heads=2, seed=0)
    else:  # ChatGLM v1: THUDM layout, no HF class
        return test_chatglm.write_source(directory / "v1", test_chatglm.v1_weights(test_chatglm.V1_CONFIG),
                                         test_chatglm.V1_CONFIG)
    return parity.save_hf(parity.reinit_(hf, seed=3), directory)


@pytest.mark.parametrize("arch", ["opt", "falcon", "falcon_alibi", "mixtral", "glm", "chatglm_v1"])
def test_tuned_convert_of_every_architecture_is_packed_exactly(arch, tmp_path):
    """Tuning runs through every architecture's layers (a gradient for every op in torch mode) and the
    tuned checkpoint's logits equal the hand-dequantized reference's."""
    from test_quant import _logits, float_reference

    from bestiary.core.quant.apply import set_compute_dtype
    from bestiary.core.runtime.engine import Engine

    src = _source(arch, tmp_path / "src")
    quant = QuantConfig(quant_algo="W4A16", group_size=32, has_zero_point=True)
    convert(src, tmp_path / "q", ConvertOptions(quantization=quant, tune_steps=2), show_progress=False)
    tensors = load_file(str(tmp_path / "q" / "rank0.safetensors"))
    zeros = [t for k, t in tensors.items() if k.endswith(".zeros")]
    assert zeros and all((z != z.round()).any() for z in zeros)  # tuned: no longer GPTQ's integers
    engine = Engine.load(tmp_path / "q")
    set_compute_dtype(engine.model, torch.float32)
    ref = Engine.load(float_reference(tmp_path / "q", tmp_path / "ref"))
    prompt = list(range(3, 15))
    ours, theirs = _logits(engine, prompt), _logits(ref, prompt)
    assert (ours - theirs).abs().max() < 1e-4 * max(1.0, theirs.abs().max().item())


# --- the flag ------------------------------------------------------------------------------------
def test_tune_steps_default_and_refusals():
    int4 = QuantConfig(quant_algo="W4A16", group_size=64)
    assert check_tune_steps(int4, "gptq", None) == DEFAULT_STEPS
    assert check_tune_steps(int4, "rtn", None) == 0
    assert check_tune_steps(QuantConfig(quant_algo="W8A16"), "rtn", None) == 0
    assert check_tune_steps(int4, "gptq", 0) == 0 and check_tune_steps(int4, "gptq", 7) == 7
    with pytest.raises(ConfigError, match=r"^--tune_steps -1: expected 0"):
        check_tune_steps(int4, "gptq", -1)
    with pytest.raises(ConfigError, match=r"^--tune_steps 5: tunes int4 GPTQ weights only"):
        check_tune_steps(int4, "rtn", 5)
    with pytest.raises(ConfigError, match="tunes int4 GPTQ weights only"):
        check_tune_steps(QuantConfig(quant_algo="W4A8_AWQ", group_size=64), "rtn", 5)


def test_cli_tune_steps_refused_before_writing(tiny_src, tmp_path):
    cmd = [sys.executable, "-m", "bestiary.core.cli", "convert", "--model_dir", str(tiny_src),
           "--output_dir", str(tmp_path / "bad"), "--use_weight_only", "--tune_steps", "5"]
    bad = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--tune_steps 5" in bad.stderr
    assert not (tmp_path / "bad").exists()
