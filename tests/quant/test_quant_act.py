"""Activation-quantized modes (FP8, W8A8_SQ_PER_CHANNEL, W4A8_AWQ): layouts, convert, run, refusals.

Each converted engine is compared with a reference written here from the layout docs only:
the float engine of the same model, in which every quantized layer's output is replaced (a
forward hook) by the product computed by hand from the stored tensors: the input times its
prequant_scaling_factor, rounded to the activation grid (x / s_a to e4m3 or int8 codes), times
the stored weight codes (fp8, int8, or int4 nibbles (q - 8) * s[group]), times the scales, as
a W8A8 / FP8 GEMM with exact products and float32 accumulation computes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from parity import EngineRunner
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format import packing
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import ConfigError
from bestiary.core.layers.linear import Linear, Parallel
from bestiary.core.quant.act_slot import ActQuantSlot
from bestiary.core.quant.apply import quantized_linears
from bestiary.core.quant.input_stats import LinearInputStats
from bestiary.core.quant.modes import LinearQuant
from bestiary.core.quant.options import QuantFlags, quant_config_from_flags
from bestiary.core.runtime.engine import Engine

MODES = {
    "fp8": QuantConfig(quant_algo="FP8"),
    "sq": QuantConfig(quant_algo="W8A8_SQ_PER_CHANNEL", pre_quant_scale=True),
    "w4a8_g32": QuantConfig(quant_algo="W4A8_AWQ", group_size=32, pre_quant_scale=True),
}


# --- the reference, by hand ------------------------------------------------------------------
def weight_by_hand(t: dict[str, torch.Tensor], prefix: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight codes float32 [N, K], the scale the product is multiplied by: [1] or [N]; int4: [N, K]
    dequantized by group, scale 1) from the stored tensors of `prefix`."""
    w, s = t[f"{prefix}.weight"], t[f"{prefix}.weights_scaling_factor"].float()
    if w.dtype in (torch.float8_e4m3fn, torch.int8):
        return w.float(), s
    q = torch.empty(w.shape[0], w.shape[1] * 2)
    q[:, 0::2], q[:, 1::2] = (w & 0xF).float(), (w >> 4).float()
    return (q - 8) * s.repeat_interleave(group, 1)[:, : q.shape[1]], torch.ones(1)


def act_by_hand(x: torch.Tensor, p: torch.Tensor | None, s_a: torch.Tensor, int8: bool) -> torch.Tensor:
    """Activation codes of x * p on the grid of s_a: int8 round-to-nearest or e4m3 (as float32)."""
    x = x.float() * (1.0 if p is None else p.float())
    if int8:
        return torch.round(x / s_a).clamp(-127, 127)
    return (x / s_a).clamp(-448, 448).to(torch.float8_e4m3fn).float()


def layer_by_hand(t: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, group: int, int8: bool,
                  rounded: bool = True) -> torch.Tensor:
    """y [T, N] of quantized layer `prefix` for input x [T, K]; rounded=False: no activation rounding."""
    codes, s_w = weight_by_hand(t, prefix, group)
    p, s_a = t.get(f"{prefix}.prequant_scaling_factor"), t[f"{prefix}.activation_scaling_factor"].float()
    if not rounded:
        return (x.float() * (1.0 if p is None else p.float())) @ (codes * s_w.reshape(-1, 1)).t()
    return (act_by_hand(x, p, s_a, int8) @ codes.t()) * (s_a * s_w)


def reference_engine(ckpt: Path, out: Path, rounded: bool = True) -> Engine:
    """The float engine of the same model whose quantized layers compute `layer_by_hand`."""
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "rank0.safetensors"))
    group, int8 = config["quantization"]["group_size"], config["quantization"]["quant_algo"].startswith("W8A8")
    prefixes = {k.rpartition(".")[0] for k in tensors if k.endswith(".activation_scaling_factor")}
    plain = {}
    for key, t in tensors.items():
        prefix, _, name = key.rpartition(".")
        if prefix in prefixes and name == "weight":  # any float weight of the right shape: the hook decides
            plain[key] = torch.zeros(t.shape[0], tensors[f"{prefix}.prequant_scaling_factor"].shape[0]
                                     if f"{prefix}.prequant_scaling_factor" in tensors else t.shape[1])
        elif prefix not in prefixes or name == "bias":
            plain[key] = t
    config["quantization"] = QuantConfig().model_dump(mode="json")
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(plain, str(out / "rank0.safetensors"))
    engine = Engine.load(out)
    engine.model._lm_head_t = engine.model._lm_head_tiles = None  # logits through the lm_head Linear (and its hook)
    for path, module in engine.model.named_modules():
        if hasattr(module, "_fused"):
            module._fused = module._fused_tiles = None  # fc and gate run as their own Linears (each has its own scales)
        if path in prefixes:
            def hook(m, args, y, path=path):
                x = args[0].reshape(-1, args[0].shape[-1])
                out = layer_by_hand(tensors, path, x, group, int8, rounded)
                return out.to(y.dtype).view(y.shape) + (0 if m.bias is None else m.bias)
            module.register_forward_hook(hook)
    assert len(prefixes) == 2 * 5 + 1  # qkv, dense, fc, gate, proj per layer; lm_head
    return engine


def _logits(engine: Engine, prompt: list[int], steps: int = 3) -> torch.Tensor:
    runner = EngineRunner(engine, max_tokens=64)
    out = [runner.feed(prompt, all_logits=True)]
    for _ in range(steps):
        out.append(runner.feed([int(out[-1][-1].argmax())]))
    return torch.cat(out)


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("quant_act"), intermediate_size=128)


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_logits_equal_hand_written_reference(mode, tiny_src, tmp_path):
    quant = MODES[mode]
    convert(tiny_src, tmp_path / "q", ConvertOptions(quantization=quant), show_progress=False)
    section = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert section["quant_algo"] == quant.quant_algo
    engine = Engine.load(tmp_path / "q")
    assert all(isinstance(m.quant, ActQuantSlot) for m in quantized_linears(engine.model).values())
    prompt = list(range(3, 15))
    ours = _logits(engine, prompt)
    theirs = _logits(reference_engine(tmp_path / "q", tmp_path / "ref"), prompt)
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max() < 1e-4 * scale
    # broken variant: the same weights without activation rounding are measurably different
    unrounded = _logits(reference_engine(tmp_path / "q", tmp_path / "ref2", rounded=False), prompt)
    assert (ours - unrounded).abs().max() > 1e-3 * scale


# --- one layer -------------------------------------------------------------------------------
def _stats(x: torch.Tensor) -> LinearInputStats:
    return LinearInputStats(x.abs().amax(0), float(x.abs().max()), x.t() @ x, x.shape[0])


def _outlier_inputs(t: int = 64, k: int = 128, seed: int = 0) -> torch.Tensor:
    """Activations with a few channels ~50x wider than the rest (as in LLM residual streams)."""
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed))
    x[:, [3, 40, 77]] *= 50
    return x


def _installed(lq: LinearQuant, w: torch.Tensor, x: torch.Tensor, alpha: float | None = None) -> Linear:
    lin = Linear(w.shape[1], w.shape[0], parallel=Parallel.COLUMN)
    lin.name = "layer"
    slot = ActQuantSlot.install(lin, lq)
    if alpha is not None:
        slot.alpha = alpha
    for name, t in slot.quantize(w, torch.float32, _stats(x)).items():
        assert getattr(lin, name).shape == t.shape and getattr(lin, name).dtype == t.dtype, name
        getattr(lin, name).data = t
    return lin


def test_fp8_packing_round_trip_exact():
    gen = torch.Generator().manual_seed(0)
    codes = (torch.randn(48, 64, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes[0, 0] = 448.0  # the largest code sets the scale exactly
    w = codes.float() * 0.125  # exactly representable: w / s gives the codes back
    q, s = packing.quantize_fp8_per_tensor(w)
    assert s.item() == 0.125 and torch.equal(q.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(packing.dequantize_fp8(q, s), w)
    lin = _installed(LinearQuant("FP8", 8), w, torch.randn(8, 64, generator=gen))
    assert torch.equal(lin.quant.dequantize(lin), w)


def test_layer_equals_quantized_activations_times_dequantized_weight():
    """One layer per mode, against layer_by_hand (every token count, incl. 1)."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) / 11
    x = _outlier_inputs()
    for lq in (LinearQuant("FP8", 8), LinearQuant("W8A8_SQ_PER_CHANNEL", 8), LinearQuant("W4A8_AWQ", 4, 32)):
        lin = _installed(lq, w, x)
        t = {f"l.{n}": p.data for n, p in lin.named_parameters()}
        int8 = lq.algo.startswith("W8A8")
        for tokens in (1, 5, 64):
            ref = layer_by_hand(t, "l", x[:tokens], 32, int8)
            assert (lin(x[:tokens]) - ref).abs().max() < 1e-5 * ref.abs().max(), lq.algo
        exact = layer_by_hand(t, "l", x, 32, int8, rounded=False)  # broken variant: no activation rounding
        assert (lin(x) - exact).abs().max() > 1e-3 * exact.abs().max(), lq.algo


@pytest.mark.parametrize("k", [64, 1024, 1040, 3072])
def test_int8_matmul_is_exact_on_either_side_of_the_float32_bound(k):
    """The CPU's int8 x int8 GEMM (a float GEMM: float32 up to K = 1024, float64 past it) equals the exact int64
    product, at the extreme codes where a float32 sum past K = 1024 would round: row 0's sum is (K - 1) 2^14 +
    127^2, odd and above 2^24 (a float32 GEMM at K = 1040 or 3072 gets it wrong)."""
    from bestiary.core.quant.act_slot import _int8_matmul

    gen = torch.Generator().manual_seed(k)
    a = torch.randint(-128, 128, (5, k), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (7, k), generator=gen, dtype=torch.int8)
    a[0], w[0] = -128, -128  # every product 2^14 ...
    a[0, -1], w[0, -1] = 127, 127  # ... but one odd 127^2: an odd sum, past 2^24 from K = 1025 on
    a[1, ::2] = 127  # odd sums: an integer float32 cannot hold past 2^24
    exact = a.long() @ w.long().t()
    y = _int8_matmul(a, w)
    assert y.dtype == torch.int32 and torch.equal(y.long(), exact)


def test_smoothquant_reduces_activation_error_on_outlier_channels():
    """int8 per-tensor activations: with outlier channels, smoothing (alpha 0.5) beats none."""
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(2)) / 11
    x = _outlier_inputs()
    y = x @ w.t()

    def err(out: torch.Tensor) -> float:
        return ((out - y).norm() / y.norm()).item()

    q, s = packing.quantize_int8_per_channel(w)  # no smoothing: plain W8A8, by hand
    s_a = x.abs().max().item() / 127
    plain = err((torch.round(x / s_a).clamp(-127, 127) * s_a) @ (q.float() * s[:, None]).t())
    smoothed = err(_installed(LinearQuant("W8A8_SQ_PER_CHANNEL", 8), w, x, alpha=0.5)(x))
    assert smoothed < 0.5 * plain, (smoothed, plain)
    lin = _installed(LinearQuant("W8A8_SQ_PER_CHANNEL", 8), w, x, alpha=0.5)
    p = lin.prequant_scaling_factor
    assert p[[3, 40, 77]].max() < p.median() / 3  # the outlier channels are scaled down
    # smoothing alone keeps the function: (x * p) (W / p)^T = x W^T up to weight rounding
    assert ((x * p) @ lin.quant.dequantize(lin).t() - y).norm() / y.norm() < 0.01


def test_w4a8_layout_prequant_scale_and_group_scales():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(3)) / 11
    x = _outlier_inputs()
    lin = _installed(LinearQuant("W4A8_AWQ", 4, 32), w, x)
    assert lin.weight.dtype == torch.uint8 and lin.weight.shape == (48, 64)
    assert lin.weights_scaling_factor.shape == (48, 4) and lin.prequant_scaling_factor.shape == (128,)
    p = lin.prequant_scaling_factor
    assert p.max() / p.min() > 1.5  # the AWQ scales are not all one on outlier inputs
    smoothed = w / p[None, :]  # W diag(s), s = 1 / p: what was quantized
    groups = smoothed.abs().reshape(48, 4, 32).amax(-1) / 7  # symmetric group scales
    assert torch.allclose(lin.weights_scaling_factor, groups, rtol=1e-6)
    assert ((lin.quant.dequantize(lin) - smoothed).abs() <= groups.repeat_interleave(32, 1) / 2 + 1e-6).all()
    s_a = lin.activation_scaling_factor.item()
    assert s_a == pytest.approx((x.abs().amax(0) * p).max().item() / 448, rel=1e-6)


def test_stats_are_required():
    lin = Linear(64, 32)
    lin.name = "layer"
    slot = ActQuantSlot.install(lin, LinearQuant("FP8", 8))
    with pytest.raises(ValueError, match="needs the layer's input statistics"):
        slot.quantize(torch.randn(32, 64), torch.float32)


# --- flags and refusals ----------------------------------------------------------------------
@pytest.mark.parametrize("flags,message", [
    (QuantFlags(fp8=True, use_weight_only=True), "--use_weight_only and --fp8: pick one"),
    (QuantFlags(smoothquant=1.5), r"--smoothquant 1.5: expected .* 0 < alpha <= 1"),
    (QuantFlags(smoothquant=0.0), r"--smoothquant 0.0: expected"),
    (QuantFlags(fp8=True, group_size=64), "--group_size: not with --fp8"),
    (QuantFlags(w4a8_awq=True, has_zero_point=True), "--has_zero_point: not with --w4a8_awq"),
    (QuantFlags(w4a8_awq=True, group_size=48), "--group_size 48: expected"),
    (QuantFlags(smoothquant=0.5, weight_only_precision="int8"), "--weight_only_precision: only with"),
])
def test_bad_flag_combinations(flags, message):
    with pytest.raises(ConfigError, match=message):
        quant_config_from_flags(flags)


def test_flags_to_config():
    q = quant_config_from_flags(QuantFlags(w4a8_awq=True, exclude_modules=["lm_head"]))
    assert (q.quant_algo, q.group_size, q.pre_quant_scale, q.exclude_modules) == ("W4A8_AWQ", 128, True, ["lm_head"])
    assert quant_config_from_flags(QuantFlags(smoothquant=0.8)).quant_algo == "W8A8_SQ_PER_CHANNEL"
    assert quant_config_from_flags(QuantFlags(fp8=True, fp8_kv_cache=True)).kv_cache_quant_algo == "FP8"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bestiary.core.cli", "convert", *args],
                          capture_output=True, text=True, check=False)


@pytest.mark.parametrize("flags,message", [
    (["--fp8", "--use_weight_only"], "pick one"),
    (["--smoothquant", "1.5"], "--smoothquant 1.5"),
    (["--w4a8_awq", "--tp_size", "2"], "--group_size 128: transformer.layers.0.attention.dense has 32 input "
                                       "features per tensor-parallel rank"),
])
def test_cli_refusals_exit_2_with_one_line(flags, message, tmp_path):
    src = make_tiny_llama(tmp_path)  # hidden 64: attention.dense has 32 input features per rank at tp 2
    bad = _cli("--model_dir", str(src), "--output_dir", str(tmp_path / "bad"), *flags)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and message in bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()


def test_layer_refusals_before_writing(tiny_src, tmp_path):
    quant = QuantConfig(quant_algo="W4A8_AWQ", group_size=48, pre_quant_scale=True)
    with pytest.raises(ConfigError, match="--group_size 48: expected one of"):
        convert(tiny_src, tmp_path / "q", ConvertOptions(quantization=quant), show_progress=False)
    with pytest.raises(ConfigError, match="W4A8_AWQ weights are symmetric"):
        convert(tiny_src, tmp_path / "q",
                ConvertOptions(quantization=QuantConfig(quant_algo="W4A8_AWQ", has_zero_point=True)),
                show_progress=False)
    assert not (tmp_path / "q").exists()


def test_cli_smoothquant_alpha_reaches_the_scales(tiny_src, tmp_path):
    ok = _cli("--model_dir", str(tiny_src), "--output_dir", str(tmp_path / "cli"), "--smoothquant", "0.8")
    assert ok.returncode == 0, ok.stderr
    key = "transformer.layers.0.mlp.fc.prequant_scaling_factor"
    cli = load_file(str(tmp_path / "cli" / "rank0.safetensors"))[key]
    for alpha, same in ((0.8, True), (0.5, False)):
        convert(tiny_src, tmp_path / str(alpha), ConvertOptions(quantization=MODES["sq"], smoothquant_alpha=alpha),
                show_progress=False)
        assert torch.equal(load_file(str(tmp_path / str(alpha) / "rank0.safetensors"))[key], cli) == same
