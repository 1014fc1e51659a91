"""Calibrated weight quantization: activation statistics, GPTQ, the AWQ scale search, and the
calibrated convert (core.quant.input_stats / gptq / awq / calibrated).

GPTQ is checked against its objective (trace(dW H dW^T) below round to nearest on correlated
inputs), against RTN exactly where they must agree (H = identity), and end to end: a converted
checkpoint's logits equal a float model holding the hand-dequantized weights (test_quant's
reference)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from kv_scales import expected_kv_scales
from test_quant import _logits, float_reference
from tiny_llama import make_tiny_llama

from bestiary.core.convert.calibration import collect_linear_inputs
from bestiary.core.convert.quantize_calibrated import check_weight_quantizer, float_model
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format import packing
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import ConfigError
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.quant import gptq
from bestiary.core.quant.apply import quantized_linears, set_compute_dtype
from bestiary.core.quant.awq import awq_scale, search_awq_scale
from bestiary.core.quant.awq_fold import fold_awq_scales, scale_folds
from bestiary.core.quant.gptq import act_order_perm, gptq_int4, hessian_error
from bestiary.core.quant.input_stats import LinearInputStats
from bestiary.core.quant.modes import LinearQuant
from bestiary.core.quant.slot import WeightOnlySlot
from bestiary.core.runtime.engine import Engine


def correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """x [T, K] with correlated features and a few large channels (as LLM activations have)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    x = torch.randn(tokens, k, generator=gen) @ mix
    x[:, :3] *= 8.0  # outlier channels
    return x


def rtn(w: torch.Tensor, group: int, zero: bool) -> torch.Tensor:
    codes, s, z = packing.quantize_int4_groupwise(w, group, zero)
    return packing.dequantize_int4(codes, s, z, group)


# --- GPTQ ------------------------------------------------------------------------------------
@pytest.mark.parametrize("group,zero", [(64, False), (128, True), (32, True)])
def test_gptq_lowers_output_error_below_round_to_nearest(group, zero):
    w = torch.randn(48, 192, generator=torch.Generator().manual_seed(1))
    x = correlated_inputs(1024, 192)
    h = x.t() @ x
    codes, s, z = gptq_int4(w, h, group, zero)
    assert codes.dtype == torch.uint8 and codes.shape == w.shape and int(codes.max()) <= 15
    assert s.shape == (48, packing.num_groups(192, group)) and (z is not None) == zero
    ours = hessian_error(packing.dequantize_int4(codes, s, z, group) - w, h)
    theirs = hessian_error(rtn(w, group, zero) - w, h)
    assert ours < 0.8 * theirs, (ours, theirs)
    # the output error over the actual inputs is what trace(dW H dW^T) says
    dw = packing.dequantize_int4(codes, s, z, group) - w
    assert abs(((x @ dw.t()) ** 2).sum().item() - ours) < 1e-3 * ours


@pytest.mark.parametrize("group,zero,k", [(64, False, 192), (128, True, 192), (64, True, 96)])
def test_gptq_with_identity_hessian_is_round_to_nearest(group, zero, k):
    w = torch.randn(32, k, generator=torch.Generator().manual_seed(2))
    codes, s, z = gptq_int4(w, torch.eye(k) * 3.0, group, zero, clip=False)
    ref_codes, ref_s, ref_z = packing.quantize_int4_groupwise(w, group, zero)
    assert torch.equal(codes, ref_codes) and torch.equal(s, ref_s)
    assert (z is None and ref_z is None) or torch.equal(z, ref_z)
    # with correlated inputs the error is propagated and the codes change (the check can fail)
    x = correlated_inputs(512, k)
    assert not torch.equal(gptq_int4(w, x.t() @ x, group, zero, clip=False)[0], ref_codes)


def test_gptq_leaves_its_input_alone():
    """Bug: a weight held as W^T's view (the CPU layout) came back overwritten with GPTQ's updates."""
    w = torch.randn(96, 32, generator=torch.Generator().manual_seed(6)).t()  # [32, 96], w.t() contiguous
    before = w.clone()
    x = correlated_inputs(256, 96)
    gptq_int4(w, x.t() @ x, 32, True)
    assert torch.equal(w, before)


@pytest.mark.parametrize("zero", [False, True])
def test_clip_search_never_loses_to_the_min_max_grid(zero):
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(7))
    w[:4, 0] *= 6.0  # outlier weights: clipping them buys a finer step for the rest
    x = correlated_inputs(512, 32)
    h = x.t() @ x

    def row_errors(s, z):
        dw = gptq.fake_quantize_group(w, s, z) - w
        return ((dw @ h) * dw).sum(dim=1)

    searched = row_errors(*gptq.search_group_grid(w, h, zero, torch.float32))
    plain = row_errors(*gptq.group_grid(w, zero, 1.0, torch.float32))
    assert (searched <= plain + 1e-6 * plain).all()
    assert searched.sum() < 0.95 * plain.sum()  # and clips somewhere
    # ratio 1.0 is quantize_int4_groupwise's grid
    _, ref_s, ref_z = packing.quantize_int4_groupwise(w, 32, zero)
    s, z = gptq.group_grid(w, zero, 1.0, torch.float32)
    assert torch.equal(s, ref_s[:, 0]) and torch.equal(z, ref_z[:, 0] if zero else torch.full_like(s, 8.0))


def test_clip_search_lowers_gptq_output_error():
    w = torch.randn(48, 192, generator=torch.Generator().manual_seed(8))
    x = correlated_inputs(1024, 192)
    h = x.t() @ x
    errors = {}
    for clip in (False, True):
        codes, s, z = gptq_int4(w, h, 64, True, clip=clip)
        errors[clip] = hessian_error(packing.dequantize_int4(codes, s, z, 64) - w, h)
    assert errors[True] < errors[False], errors


def test_gptq_scales_rounded_to_the_checkpoint_dtype():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    x = correlated_inputs(256, 128)
    codes, s, z = gptq_int4(w, x.t() @ x, 64, True, scale_dtype=torch.bfloat16)
    assert torch.equal(s, s.to(torch.bfloat16).float())  # stored exactly: codes match what is loaded
    # column 0 has no error to absorb yet: its codes are rounded with the bf16 scale, not the float32 one
    assert torch.equal(codes[:, 0].float(), (torch.round(w[:, 0] / s[:, 0]) + z[:, 0]).clamp(0, 15))


def test_act_order_permutation_sorts_the_hessian_diagonal():
    x = correlated_inputs(256, 64)
    h = x.t() @ x
    perm = act_order_perm(h)
    assert sorted(perm.tolist()) == list(range(64))
    d = torch.diagonal(h)[perm]
    assert (d[:-1] >= d[1:]).all() and set(perm[:3].tolist()) == {0, 1, 2}  # the outlier channels first


def test_slot_quantize_with_stats_is_gptq_in_the_checkpoint_layout():
    n, k = 48, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(4))
    x = correlated_inputs(512, k)
    stats = LinearInputStats(x.abs().amax(0), float(x.abs().max()), x.t() @ x, 512)
    lin = Linear(k, n, parallel=Parallel.COLUMN)
    lin.name = "layer"
    slot = WeightOnlySlot.install(lin, LinearQuant("W4A16", 4, 64, True))
    packed = slot.quantize(w, torch.float32, stats)
    for name, t in packed.items():
        getattr(lin, name).data = t
    codes, s, z = gptq_int4(w, stats.hessian, 64, True)
    assert torch.equal(slot.dequantize(lin), packing.dequantize_int4(codes, s, z, 64))
    assert torch.equal(packed["weight"], packing.pack_int4(codes))
    assert not torch.equal(slot.quantize(w, torch.float32)["weight"], packed["weight"])  # RTN differs


# --- AWQ scale search ------------------------------------------------------------------------
def test_awq_search_protects_salient_channels():
    k = 128
    w = torch.randn(64, k, generator=torch.Generator().manual_seed(5))
    x = correlated_inputs(512, k)
    x[:, 10:14] *= 20.0  # a few very salient channels
    h = x.t() @ x
    stats = LinearInputStats(x.abs().amax(0), float(x.abs().max()), h, 512)

    def quantize(m):
        return rtn(m, 64, False)

    s = search_awq_scale(w, stats, quantize)
    assert s.shape == (k,) and torch.allclose(s.max() * s.min(), torch.tensor(1.0), atol=1e-4)
    err = hessian_error(quantize(w * s) / s - w, h)
    plain = hessian_error(quantize(w) - w, h)
    assert err < 0.9 * plain  # scaling helps here ...
    assert s[10:14].min() > s.median()  # ... by enlarging the salient channels
    assert torch.equal(awq_scale(stats.absmax, 0.0), torch.ones(k))
    with pytest.raises(ValueError, match="needs the input Hessian"):
        search_awq_scale(w, LinearInputStats(stats.absmax, stats.amax, None, 512), quantize)


def _search_all_float64(weights, hessian, salience, quantize, grid=20):
    """search_shared_scale as it was: every candidate's error in float64, the first smallest wins."""
    best_s, best_err = torch.ones(weights[0].shape[1]), float("inf")
    for i in range(grid):
        s = awq_scale(salience, i / grid)
        err = sum(hessian_error(quantize(w.float() * s) / s - w.float(), hessian) for w in weights)
        if err < best_err:
            best_s, best_err = s, err
    return best_s


@pytest.mark.parametrize("seed", range(6))
def test_awq_search_picks_the_all_float64_choice(seed):
    """The float32 first pass only narrows the candidates: the scale chosen is the one the all-float64
    search chooses (two weights sharing one input, salient channels of several strengths)."""
    from bestiary.core.quant.awq import search_shared_scale

    g = torch.Generator().manual_seed(seed)
    k = 96
    x = correlated_inputs(256, k)
    x[:, torch.randint(0, k, (6,), generator=g)] *= 1 + 30 * torch.rand(1, generator=g).item()
    h = x.t() @ x
    weights = [torch.randn(40, k, generator=g), torch.randn(24, k, generator=g) * 3]
    salience = x.abs().amax(0)

    def quantize(m):
        return rtn(m, 32, seed % 2 == 0)

    chosen = search_shared_scale(weights, h, salience, quantize)
    assert torch.equal(chosen, _search_all_float64(weights, h, salience, quantize))
    if seed == 0:
        assert not torch.equal(chosen, torch.ones(k))  # a case where scaling wins


# --- statistics on a model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("gptq"), intermediate_size=128)


def _float_model(src, tmp_path):
    """The tiny model as core.convert.quantize_calibrated builds it for calibration (int4-selected linears float)."""
    from bestiary.core.format.checkpoint import load_rank_weights
    from bestiary.core.format.config import read_json
    from bestiary.core.runtime.engine import validate_model_config
    from bestiary.registry import default_registry, resolve

    ckpt = convert(src, tmp_path / "f", show_progress=False)
    config = validate_model_config(read_json(ckpt / "config.json"), "tiny")
    config.quantization = QuantConfig(quant_algo="W4A16", group_size=32)
    model_class = resolve(default_registry().get(config.architecture).model_class)
    tensors = load_rank_weights(ckpt, 0)
    tensors["lm_head.weight"] = tensors["lm_head.weight"].float()
    keys = {k for k in tensors if k.endswith(".weight") and ("attention." in k or "mlp." in k or k == "lm_head.weight")}
    model, names = float_model(model_class, config, 0, tensors, keys)
    return model, names, tensors, config


def test_activation_stats_match_a_hand_computation(tiny_src, tmp_path):
    import transformers

    model, names, tensors, config = _float_model(tiny_src, tmp_path)
    ids = torch.randint(0, config.vocab_size, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    stats = collect_linear_inputs(model, ids, hessian=True, chunk=128)  # two sequences: 128 + 72 tokens
    assert set(stats) == set(names.values()) and all(st.tokens == 200 for st in stats.values())
    # layer 0's qkv input, by hand: RMSNorm of the embeddings
    emb = tensors["transformer.vocab_embedding.weight"][ids]  # [T, H]
    x = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + config.norm_epsilon)
    x = x * tensors["transformer.layers.0.input_layernorm.weight"]
    qkv = stats["transformer.layers.0.attention.qkv"]
    assert torch.allclose(qkv.absmax, x.abs().amax(0), rtol=1e-5, atol=1e-6)
    assert qkv.amax == pytest.approx(float(x.abs().max()), rel=1e-5)
    assert torch.allclose(qkv.hessian, x.t() @ x, rtol=1e-4, atol=1e-4)
    # lm_head's input: HF's final normed hidden states, each chunk its own sequence
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_src).eval()
    with torch.no_grad():
        hidden = torch.cat([hf(torch.tensor([part]), output_hidden_states=True).hidden_states[-1][0]
                            for part in (ids[:128], ids[128:])])
    head = stats["lm_head"]
    assert torch.allclose(head.hessian, hidden.t() @ hidden, rtol=1e-3, atol=1e-3 * float(head.hessian.abs().max()))
    assert torch.allclose(head.absmax, hidden.abs().amax(0), rtol=1e-4, atol=1e-5)
    no_h = collect_linear_inputs(model, ids[:50], hessian=False, names={"lm_head"})
    assert set(no_h) == {"lm_head"} and no_h["lm_head"].hessian is None


# --- calibrated convert ----------------------------------------------------------------------
@pytest.mark.parametrize("quant", [QuantConfig(quant_algo="W4A16", group_size=32),
                                   QuantConfig(quant_algo="W4A16", group_size=64, has_zero_point=True)],
                         ids=["g32", "g64_zp"])
def test_gptq_convert_logits_equal_hand_dequantized_reference(quant, tiny_src, tmp_path):
    convert(tiny_src, tmp_path / "q", ConvertOptions(quantization=quant), show_progress=False)  # int4 default: gptq
    engine = Engine.load(tmp_path / "q")
    set_compute_dtype(engine.model, torch.float32)
    assert len(quantized_linears(engine.model)) == 2 * 5 + 1
    ref = Engine.load(float_reference(tmp_path / "q", tmp_path / "ref"))
    prompt = list(range(3, 15))
    ours, theirs = _logits(engine, prompt), _logits(ref, prompt)
    assert (ours - theirs).abs().max() < 1e-4 * max(1.0, theirs.abs().max().item())
    convert(tiny_src, tmp_path / "rtn", ConvertOptions(quantization=quant, weight_quantizer="rtn"), show_progress=False)
    gptq_w = load_file(str(tmp_path / "q" / "rank0.safetensors"))
    rtn_w = load_file(str(tmp_path / "rtn" / "rank0.safetensors"))
    assert gptq_w.keys() == rtn_w.keys()
    assert not torch.equal(gptq_w["transformer.layers.1.mlp.proj.weight"], rtn_w["transformer.layers.1.mlp.proj.weight"])
    # AWQ scales are folded into the norms (core.quant.awq_fold); what no fold touches is as read
    assert not torch.equal(gptq_w["transformer.layers.1.post_layernorm.weight"],
                           rtn_w["transformer.layers.1.post_layernorm.weight"])
    for key in ("transformer.vocab_embedding.weight", "transformer.ln_f.weight"):
        assert torch.equal(gptq_w[key], rtn_w[key])


def test_folded_awq_scales_leave_the_float_model_unchanged(tiny_src, tmp_path):
    """Folding s into the producers and the consumers' columns is exact: same logits before quantizing."""
    convert(tiny_src, tmp_path / "f", show_progress=False)
    engine = Engine.load(tmp_path / "f")
    tensors = load_file(str(tmp_path / "f" / "rank0.safetensors"))
    keys = {k for k in tensors if k.endswith((".qkv.weight", ".fc.weight", ".gate.weight", ".proj.weight"))}
    folds = scale_folds(engine.model, keys)
    assert len(folds) == 3 * engine.model.config.num_hidden_layers
    assert {f.producers[0].rsplit(".", 2)[-2] for f in folds} == {"input_layernorm", "post_layernorm", "gate"}
    stats = {}
    for key in keys:
        x = correlated_inputs(256, tensors[key].shape[1], seed=len(stats))
        x[:, 5] *= 30.0  # a salient channel makes alpha > 0 worth it
        stats[key] = LinearInputStats(x.abs().amax(0), float(x.abs().max()), x.t() @ x, 256)

    def quantize(key, w):
        return rtn(w, 32, False)

    before = {k: v.clone() for k, v in tensors.items()}
    hessians = {k: st.hessian.clone() for k, st in stats.items()}
    made = fold_awq_scales(tensors, folds, stats, {k: k for k in keys}, quantize)
    assert made and all(not torch.equal(tensors[k], before[k]) for k in made)
    for key, s in made.items():  # the consumers' statistics are now those of x / s
        assert torch.allclose(stats[key].hessian * s[:, None] * s[None, :], hessians[key], rtol=1e-4, atol=1e-3)
    out = tmp_path / "folded"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "f" / "config.json").read_text())
    save_file(tensors, str(out / "rank0.safetensors"))
    prompt = list(range(3, 15))
    ours, theirs = _logits(Engine.load(out), prompt), _logits(engine, prompt)
    assert (ours - theirs).abs().max() < 1e-4 * max(1.0, theirs.abs().max().item())


def test_gptq_with_tied_lm_head_and_int8_kv_cache(tmp_path):
    src = make_tiny_llama(tmp_path, intermediate_size=128, tie_word_embeddings=True)
    quant = QuantConfig(quant_algo="W4A16", group_size=32, kv_cache_quant_algo="INT8")
    convert(src, tmp_path / "q", ConvertOptions(quantization=quant), show_progress=False)
    tensors = load_file(str(tmp_path / "q" / "rank0.safetensors"))
    assert tensors["lm_head.weight"].dtype == torch.uint8
    assert tensors["transformer.vocab_embedding.weight"].dtype == torch.float32
    # calibrated after the calibrated weights were written: amax / 127 of K and V of the same
    # W4A16 weights with a float KV cache, over the KV calibration ids
    weights_only = quant.model_copy(update={"kv_cache_quant_algo": None})
    convert(src, tmp_path / "w", ConvertOptions(quantization=weights_only), show_progress=False)
    weights = load_file(str(tmp_path / "w" / "rank0.safetensors"))
    assert all(torch.equal(tensors[k], w) for k, w in weights.items())  # the same packed weights
    for layer, expected in enumerate(expected_kv_scales(Engine.load(tmp_path / "w"), 127.0)):
        scales = tensors[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"]
        torch.testing.assert_close(scales, expected, rtol=1e-5, atol=0)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "INT8"


@pytest.mark.parametrize("quant,method,message", [
    (QuantConfig(quant_algo="W8A16"), "gptq", "only for int4 weights"),
    (None, "gptq", "needs a weight quantization mode"),
    (QuantConfig(quant_algo="W4A16"), "awq", "expected one of rtn, gptq"),
])
def test_weight_quantizer_refusals(quant, method, message):
    with pytest.raises(ConfigError, match=message):
        check_weight_quantizer(quant, method)
    assert check_weight_quantizer(QuantConfig(quant_algo="W4A16"), None) == "gptq"
    assert check_weight_quantizer(QuantConfig(quant_algo="W8A16"), None) == "rtn"


def test_cli_weight_quantizer(tiny_src, tmp_path):
    base = [sys.executable, "-m", "bestiary.core.cli", "convert", "--model_dir", str(tiny_src)]
    bad = subprocess.run(base + ["--output_dir", str(tmp_path / "bad"), "--use_weight_only", "--weight_quantizer", "gptq"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "only for int4 weights" in bad.stderr
    assert not (tmp_path / "bad").exists()


def test_builtin_weight_calibration_text_is_long_and_read_whole():
    """The built-in calibration text gives GPTQ and scale tuning at least 16k SmolLM2 tokens, and
    WEIGHT_CALIB_TOKENS reads all of it (text added past the limit would be silently dropped)."""
    gguf = pytest.importorskip("gguf")
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.convert.quantize_calibrated import WEIGHT_CALIB_TOKENS, weight_calibration_ids
    from bestiary.core.format.errors import BestiaryError
    from bestiary.core.quant.calib_text import WEIGHT_CALIB_TEXT
    from bestiary.core.runtime.tokenizer import Tokenizer
    from bestiary.core.sources.gguf_tokenizer import tokenizer_from_gguf

    try:
        path = demo_model_path()
    except BestiaryError as err:
        pytest.skip(str(err))
    files = tokenizer_from_gguf(gguf.GGUFReader(path, "r"))
    every = Tokenizer(files.tokenizer_json, files.tokenizer_config).encode(WEIGHT_CALIB_TEXT)
    assert 16384 <= len(every) <= WEIGHT_CALIB_TOKENS
    assert weight_calibration_ids(files, 49152, None) == every


def _converts_alone_and_shared(src, modes: dict, tmp_path, monkeypatch) -> list:
    """Convert `src` in each of `modes` (name -> ConvertOptions keywords) alone, then all of them in order under
    shared_calibration(); assert each shared convert wrote exactly its tensors alone. Returns the list that
    counts the float model's calibration runs (one entry per run, the ones made after this call too)."""
    from bestiary.core.convert import calibration
    from bestiary.core.format.checkpoint import load_rank_weights

    alone = {m: load_rank_weights(convert(src, tmp_path / f"alone-{m}", ConvertOptions(**kw),
                                          show_progress=False), 0)
             for m, kw in modes.items()}
    runs: list = []
    real = calibration.collect_linear_inputs
    monkeypatch.setattr(calibration, "collect_linear_inputs", lambda *a, **k: runs.append(1) or real(*a, **k))
    with calibration.shared_calibration():
        shared = {m: load_rank_weights(convert(src, tmp_path / f"shared-{m}", ConvertOptions(**kw),
                                               show_progress=False), 0)
                  for m, kw in modes.items()}
    assert not calibration.shared_calibration_active()
    for m in modes:
        assert sorted(shared[m]) == sorted(alone[m])
        assert all(torch.equal(shared[m][k], alone[m][k]) for k in alone[m]), m
    return runs


def test_shared_calibration_runs_the_float_model_once_and_changes_nothing(tiny_src, tmp_path, monkeypatch):
    """Under shared_calibration(), GPTQ int4 (g32 and g64, tuned) and SmoothQuant converts of one source
    calibrate once, and write the tensors each writes alone."""
    from bestiary.core.convert import calibration

    modes = {"g32": dict(quantization=QuantConfig(quant_algo="W4A16", group_size=32, has_zero_point=True),
                         tune_steps=2),
             "g64": dict(quantization=QuantConfig(quant_algo="W4A16", group_size=64), tune_steps=2),
             "sq": dict(quantization=QuantConfig(quant_algo="W8A8_SQ_PER_CHANNEL", pre_quant_scale=True))}
    runs = _converts_alone_and_shared(tiny_src, modes, tmp_path, monkeypatch)
    assert len(runs) == 1
    with calibration.shared_calibration():  # another source (other weights): its own run
        other = make_tiny_llama(tmp_path / "other", seed=1, intermediate_size=128)
        convert(other, tmp_path / "other-ckpt", ConvertOptions(**modes["sq"]), show_progress=False)
        convert(tiny_src, tmp_path / "again", ConvertOptions(**modes["sq"]), show_progress=False)
    assert len(runs) == 3


def test_shared_calibration_serves_a_tied_head_and_its_untied_copy(tmp_path, monkeypatch):
    """A source with tied embeddings: with lm_head float the model shares its embedding (no lm_head Linear);
    with lm_head quantized it holds an untied copy. The tied one calibrates first, then GPTQ int4 of lm_head
    (its Hessian) and SmoothQuant (its activation scale) take that run: the head's input was recorded as
    lm_head's (DecoderLM.tied_head), and each convert writes what it writes alone."""
    tied = make_tiny_llama(tmp_path / "tied", intermediate_size=128, tie_word_embeddings=True)
    modes = {"head_float": dict(quantization=QuantConfig(quant_algo="W4A16", group_size=32, has_zero_point=True,
                                                         exclude_modules=["lm_head"]), tune_steps=2),
             "g32": dict(quantization=QuantConfig(quant_algo="W4A16", group_size=32), tune_steps=2),
             "sq": dict(quantization=QuantConfig(quant_algo="W8A8_SQ_PER_CHANNEL", pre_quant_scale=True))}
    runs = _converts_alone_and_shared(tied, modes, tmp_path, monkeypatch)
    assert len(runs) == 1
