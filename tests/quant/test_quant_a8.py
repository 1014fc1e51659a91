"""W8A8 / W4A8 dynamic: W8A16 / W4A16 weights with `quantization.activation_quant: int8` (`--activation_precision
int8`).

The engine (prefill on the compiled int8 x int8 / int4 x int8 kernel, decode steps as a compiled plan of it) is
compared with a reference written here: the stored int8 / int4 weights dequantized by hand (q * s, (q - z) * s
per group) into a float checkpoint,
whose float engine runs eagerly with a pre-hook on each of those Linears replacing its input x by its
per-token int8 reading (s = max |x| / 127, round(x / s) * s). Equal to float32 rounding; and measurably
unlike W8A16 (the activation rounding is real). The accuracy gate: on a tiny model's own sampled text, the
perplexity of W8A8 within 1% of W8A16's, and of W4A8 within 1% of W4A16's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from parity import EngineRunner
from safetensors.torch import load_file, save_file
from tiny_llama import make_tiny_llama

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format import packing
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import ConfigError
from bestiary.core.kernels.cpu import build
from bestiary.core.quant.apply import runtime_linears
from bestiary.core.quant.modes import linear_quant_of
from bestiary.core.quant.online_act import int8_per_token
from bestiary.core.quant.options import QuantFlags, quant_config_from_flags
from bestiary.core.runtime.engine import Engine

pytest.importorskip("transformers")  # (tiny_llama's source model)

W8A8 = QuantConfig(quant_algo="W8A16", activation_quant="int8")
W4A16 = dict(quant_algo="W4A16", group_size=32, has_zero_point=True)
W4A8 = QuantConfig(**W4A16, activation_quant="int8")
KERNELS = build.compiler() is not None and build.enabled()


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("a8"), intermediate_size=128)


def _hand_reference(ckpt: Path, out: Path) -> tuple[Path, set[str]]:
    """A float checkpoint of the int8 / int4 weights dequantized by hand, and the names of those layers."""
    config = json.loads((ckpt / "config.json").read_text())
    group = config["quantization"]["group_size"]
    tensors = load_file(str(ckpt / "rank0.safetensors"))
    plain, quantized = {}, set()
    for key, t in tensors.items():
        prefix, _, name = key.rpartition(".")
        if name in ("weights_scaling_factor", "zeros"):
            continue
        if name == "weight" and f"{prefix}.weights_scaling_factor" in tensors:
            s = tensors[f"{prefix}.weights_scaling_factor"].float()
            if t.dtype == torch.uint8:  # int4: (q - z) * s per group (z: 8 when symmetric)
                z = tensors.get(f"{prefix}.zeros")
                t = packing.dequantize_int4(packing.unpack_int4(t), s, None if z is None else z.float(), group)
            else:
                t = t.float() * s[:, None]
            quantized.add(prefix)
        plain[key] = t
    config["quantization"] = QuantConfig().model_dump(mode="json")
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(plain, str(out / "rank0.safetensors"))
    return out, quantized


def _logits(engine: Engine, prompt: list[int], steps: int = 4) -> torch.Tensor:
    runner = EngineRunner(engine, max_tokens=64)
    out = [runner.feed(prompt, all_logits=True)]  # 12 tokens: prefill
    for _ in range(steps):  # one token: decode steps
        out.append(runner.feed([int(out[-1][-1].argmax())]))
    return torch.cat(out)


@pytest.mark.parametrize("quant,weight_only", [(W8A8, QuantConfig(quant_algo="W8A16")),
                                               (W4A8, QuantConfig(**W4A16))], ids=["w8a8", "w4a8"])
def test_a8_engine_equals_int8_activations_by_hand(tiny_src, tmp_path, quant, weight_only):
    convert(tiny_src, tmp_path / "q", ConvertOptions(quantization=quant, weight_quantizer="rtn"), show_progress=False)
    section = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert (section["quant_algo"], section["activation_quant"]) == (quant.quant_algo, "int8")
    engine = Engine.load(tmp_path / "q")
    if KERNELS:  # every quantized linear (qkv, dense, fused fc + gate, proj, lm_head) on the int8-activation kernel
        assert all(m.quant.runs_a8_kernel() for m in runtime_linears(engine.model))
    ref_dir, quantized = _hand_reference(tmp_path / "q", tmp_path / "ref")
    ref = Engine.load(ref_dir)
    # the float MLP multiplies fc and gate as one fused weight (not through their modules): their shared
    # input is the MLP's, so the MLP's pre-hook quantizes it; the logits multiply ln_f's output by the
    # lm_head weight (not through its module): ln_f's forward hook quantizes that output
    sites = {name.removesuffix(".fc") for name in quantized if name not in ("lm_head",) and
             not name.endswith("mlp.gate")}
    hooked = 0
    for name, module in ref.model.named_modules():
        if name in sites:
            module.register_forward_pre_hook(lambda _m, args: (int8_per_token(args[0]).to(args[0].dtype), *args[1:]))
            hooked += 1
    assert hooked == 2 * 4 and "lm_head" in quantized, sorted(sites)
    ref.model.transformer.ln_f.register_forward_hook(lambda _m, _args, out: int8_per_token(out).to(out.dtype))
    prompt = list(range(3, 15))
    ours, theirs = _logits(engine, prompt), _logits(ref, prompt)
    if KERNELS:
        assert engine.model.__dict__["_decode_plans"][1] is not None  # decode ran as a compiled plan
    assert (ours - theirs).abs().max() < 1e-4 * max(1.0, theirs.abs().max().item())
    convert(tiny_src, tmp_path / "wo", ConvertOptions(quantization=weight_only, weight_quantizer="rtn"),
            show_progress=False)
    a16 = _logits(Engine.load(tmp_path / "wo"), prompt)
    assert (a16 - theirs).abs().max() > 1e-3  # the activation rounding is measurable


def _nll(engine: Engine, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood of `ids` (one prefill)."""
    logits = EngineRunner(engine, max_tokens=len(ids) + 1).feed(ids, all_logits=True).float()
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()


def test_a8_perplexity_gate_against_a16(tiny_src, tmp_path):
    """Text the float model wrote itself (sampled, so it is neither random nor trivially certain): W8A8's
    perplexity within 1% of W8A16's, W4A8's within 1% of W4A16's. Measured: see docs/quantization.md."""
    engines = {}
    for name, quant in (("float", QuantConfig()), ("w8a16", QuantConfig(quant_algo="W8A16")), ("w8a8", W8A8),
                        ("w4a16", QuantConfig(**W4A16)), ("w4a8", W4A8)):
        engines[name] = Engine.load(convert(tiny_src, tmp_path / name,
                                            ConvertOptions(quantization=quant,
                                                           weight_quantizer="rtn" if quant.quant_algo else None),
                                            show_progress=False))
    gen = torch.Generator().manual_seed(0)
    runner = EngineRunner(engines["float"], max_tokens=64)
    ids = [5]
    logits = runner.feed(ids)
    while len(ids) < 60:
        ids.append(int(torch.multinomial(torch.softmax(logits[-1].float(), -1), 1, generator=gen)))
        logits = runner.feed(ids[-1:])
    ppl = {name: math.exp(_nll(engine, ids)) for name, engine in engines.items()}
    print("tiny-model perplexities:", {name: round(v, 4) for name, v in ppl.items()})
    assert ppl["w8a16"] != ppl["w8a8"] and ppl["w4a16"] != ppl["w4a8"]
    assert ppl["w8a8"] <= ppl["w8a16"] * 1.01, ppl
    assert ppl["w4a8"] <= ppl["w4a16"] * 1.01, ppl


@pytest.mark.parametrize("flags,message", [
    (QuantFlags(activation_precision="int8"), "--activation_precision: needs"),
    (QuantFlags(fp8=True, activation_precision="int8"), "--activation_precision: only with --use_weight_only"),
])
def test_activation_precision_flag_refusals(flags, message):
    with pytest.raises(ConfigError, match=message):
        quant_config_from_flags(flags)


def test_activation_precision_flag_and_config():
    flags = QuantFlags(use_weight_only=True, activation_precision="int8")
    assert quant_config_from_flags(flags) == W8A8
    assert linear_quant_of(W8A8).act_quant == "int8"
    flags = QuantFlags(use_weight_only=True, weight_only_precision="int4", group_size=64, has_zero_point=True,
                       activation_precision="int8")
    w4a8 = quant_config_from_flags(flags)
    assert (w4a8.quant_algo, w4a8.group_size, w4a8.has_zero_point, w4a8.activation_quant) == ("W4A16", 64, True, "int8")
    lq = linear_quant_of(w4a8)
    assert (lq.bits, lq.group_size, lq.has_zero_point, lq.act_quant) == (4, 64, True, "int8")
    with pytest.raises(ConfigError, match="only with symmetric W8A16 or W4A16 weights .* not 'W4A16_GPTQ'"):
        linear_quant_of(QuantConfig(quant_algo="W4A16_GPTQ", activation_quant="int8"))
    with pytest.raises(ConfigError, match="activation_group_size 32"):
        linear_quant_of(QuantConfig(quant_algo="W4A16", activation_quant="int8", activation_group_size=32))
    with pytest.raises(ConfigError, match="zero points"):
        linear_quant_of(QuantConfig(quant_algo="W8A16", has_zero_point=True, activation_quant="int8"))
