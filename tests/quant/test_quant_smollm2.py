"""Quantization quality on the real model: SmolLM2-135M-Instruct perplexity per mode vs fp32.

The text: module docstrings of a fixed list of Python standard-library modules (English
technical prose and code), generated from the running interpreter, so nothing is shipped
and the same interpreter always gives the same text; the first EVAL_TOKENS tokens count.
The source GGUF is already Q4_1, so the int4 gates are at group 64 and 128 (a group-32 gate
would measure little).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch

from bestiary.core.convert.calibration import shared_calibration
from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.checkpoint import load_rank_weights
from bestiary.core.format.config import QuantConfig
from bestiary.core.layers.linear import Linear
from bestiary.core.quant.apply import quantized_linears
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.evaluate import perplexity
from bestiary.core.runtime.kv_cache import KVCache

pytestmark = pytest.mark.slow

EVAL_TOKENS = 4096
TEXT_MODULES = ("argparse", "json", "csv", "statistics", "re", "http.client", "urllib.request", "ssl", "socket",
                "unittest", "heapq", "itertools", "pydoc", "inspect", "doctest", "subprocess", "random", "typing")

INT4_W4A8_NOTE = "W4A8_AWQ g128 (FP8 activations): +79% (docs/quantization.md); the 8% gate is not reached"


class GateNotMet(AssertionError):
    """A mode's perplexity increase is above its gate (the failure a mode whose goal is not met yet expects)."""


# mode -> the increase a mode whose gate is not met yet (strict xfail on GateNotMet) must still stay within:
# a regression bound just above its measurement, so that getting worse fails rather than xfails
REGRESSION = {"W4A8_AWQ_g128": 0.82}  # measured +78.6% (2026-11-30)

# mode -> (quantization section, largest allowed perplexity increase). Every mode must also cost
# something (increase > 0) and run quantized (assert_quantized).
#
# Where the gates come from. Outside reference: llama.cpp (llama-cpp-python 0.3.36, AVX2 build)
# on the same 4096 tokens in the same two 2048-token windows, perplexity of its Q8_0 requantization
# of the shipped Q4_1 file relative to its own F32 dequantization of it (the weights our fp32
# engine runs): F32 8.0589, Q8_0 8.0956 = +0.46% (Q8_0: int8 weights in blocks of 32, and int8
# activations in blocks of 32 inside its matmuls). Reproduce: benchmarks/llamacpp_perplexity.py.
#   W8A16 1%: ~2x llama.cpp's Q8_0 (per-channel scales are coarser than blocks of 32; the
#     activations stay float).
#   INT8_KV 1%, FP8_KV 2%: llama.cpp's KV caches on its F32 weights (benchmarks/llamacpp_perplexity.py
#     --kv): f32 8.0587, f16 8.0589, q8_0 8.0607 (+0.022%), q4_0 8.4716 (+5.1%). q8_0 scales
#     blocks of 32 values at run time, a lower bound for our one static scale per layer (measured
#     INT8 +0.2%, FP8 +1.2%, docs/quantization.md); not yet checked against transformers with the
#     same per-layer scheme, so the gates stay as first set.
#   W4A16 8%: the int4 target of the quantization issue. llama.cpp's Q4_0 (no zero point) gives
#     +22.9% here and is no reference for zero-point int4 (the Q4_1 grid does not survive it).
#   FP8 9%, W8A8_SQ 37%: regression gates just above this code's own measurements (+6.8%, +35%);
#     no outside reference with static per-tensor activation scales is at hand (llama.cpp
#     quantizes activations per block of 32 at run time). 30% -> 37% when the built-in
#     calibration text grew (wider static activation ranges, commit 1e1fd15).
KV_MATCH = 0.25  # our KV increase within 25% of transformers' same-scheme increase (see the test)
MODES = {
    "W8A16": (QuantConfig(quant_algo="W8A16"), 0.01),
    "INT8_KV": (QuantConfig(kv_cache_quant_algo="INT8"), 0.01),
    "FP8_KV": (QuantConfig(kv_cache_quant_algo="FP8"), 0.02),
    # int4: zero points, lm_head float (`--exclude_modules lm_head`, TensorRT-LLM's and AutoAWQ's default)
    "W4A16_g64_zp": (QuantConfig(quant_algo="W4A16", group_size=64, has_zero_point=True,
                                 exclude_modules=["lm_head"]), 0.08),
    "W4A16_g128_zp": (QuantConfig(quant_algo="W4A16", group_size=128, has_zero_point=True,
                                  exclude_modules=["lm_head"]), 0.08),
    # activation-quantized (static per-tensor activation scales; measured +6.8% / +35% / +79%,
    # docs/quantization.md): regression gates just above the measurements (see above)
    "FP8": (QuantConfig(quant_algo="FP8"), 0.09),
    "W8A8_SQ_a0.5": (QuantConfig(quant_algo="W8A8_SQ_PER_CHANNEL", pre_quant_scale=True), 0.37),
    "W4A8_AWQ_g128": pytest.param(QuantConfig(quant_algo="W4A8_AWQ", group_size=128, pre_quant_scale=True), 0.08,
                                  marks=pytest.mark.xfail(reason=INT4_W4A8_NOTE, raises=GateNotMet, strict=True)),
}


def eval_text() -> str:
    """The fixed evaluation text (see the module docstring)."""
    return "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in TEXT_MODULES)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, smollm2_gguf):
    return tmp_path_factory.mktemp("quant_smollm2"), smollm2_gguf


@pytest.fixture(scope="module", autouse=True)
def one_calibration_run():
    """The calibrated modes (W4A16 g64 / g128, FP8, SmoothQuant, W4A8) convert one source on the same
    tokens: the float model runs over them once (core.convert.calibration.shared_calibration; each
    convert's tensors are what it writes alone: tests/quant/test_quant_gptq.py)."""
    with shared_calibration():
        yield


MEASURED: dict[str, float] = {}  # mode -> our perplexity: a mode two tests use is built and measured once


def _ppl(workdir, name: str, quant: QuantConfig | None, checkpoint: Path | None = None) -> tuple[float, Engine]:
    """`checkpoint`: an fp32 checkpoint made already (the float baseline: the session's, tests/conftest.py),
    else `quant`'s is converted here."""
    base, gguf = workdir
    if name not in MEASURED:
        if checkpoint is None:
            checkpoint = convert(gguf, base / f"{name}-ckpt", ConvertOptions(dtype="float32", quantization=quant),
                                 show_progress=False)
        build_engine(checkpoint, base / name, BuildConfig(max_seq_len=2048, max_num_tokens=512))
    engine = Engine.load(base / name)
    ids = engine.tokenizer.encode(eval_text())
    assert len(ids) >= EVAL_TOKENS
    if name not in MEASURED:
        MEASURED[name] = perplexity(engine, ids[:EVAL_TOKENS]).perplexity
    return MEASURED[name], engine


# What a quantized engine holds: the checkpoint dtype of a quantized linear's weight (int4: two
# codes per uint8), and the KV pool dtype.
WEIGHT_DTYPES = {"W8A16": torch.int8, "W4A16": torch.uint8, "FP8": torch.float8_e4m3fn,
                 "W8A8_SQ_PER_CHANNEL": torch.int8, "W4A8_AWQ": torch.uint8}
KV_DTYPES = {None: torch.float32, "INT8": torch.int8, "FP8": torch.float8_e4m3fn}


def assert_quantized(engine: Engine, quant: QuantConfig) -> None:
    """The engine runs the mode: KV pools of its code dtype, and every linear the mode selects
    (all but the excluded ones) holds packed weights of its dtype, the others float32."""
    assert KVCache.dtype_for(engine.model) == KV_DTYPES[quant.kv_cache_quant_algo]
    weights = load_rank_weights(engine.directory, 0)
    excluded = tuple(quant.exclude_modules or ())
    linears = {m.name or path: m for path, m in engine.model.named_modules() if isinstance(m, Linear)}
    selected = {name for name in linears if quant.quant_algo and not name.endswith(excluded)}
    assert {m.name or path for path, m in quantized_linears(engine.model).items()} == selected
    for name in linears:
        stored = weights.get(f"{name}.weight")  # absent: a float lm_head tied to the embedding
        if stored is not None:
            expected = WEIGHT_DTYPES[quant.quant_algo] if name in selected else torch.float32
            assert stored.dtype == expected, f"{name}: {stored.dtype}, expected {expected}"


@pytest.fixture(scope="module")
def fp32_ppl(workdir, smollm2_fp32_checkpoint):
    return _ppl(workdir, "fp32", None, smollm2_fp32_checkpoint)[0]


# The calibrated modes (GPTQ int4: GPTQ, then 40 steps of end-to-end scale tuning, 12-16 min each on one CI
# thread; FP8, SmoothQuant, W4A8_AWQ) are gated by test_quant_smollm2_calibrated.py, a file of their own: they
# share one calibration run within a process, and `make test-slow`'s workers take whole files, so they run on
# one worker while the other runs these gates and the other slow files.
CALIBRATED_MODES = ("W4A16_g64_zp", "W4A16_g128_zp", "FP8", "W8A8_SQ_a0.5", "W4A8_AWQ_g128")


def check_gate(mode: str, quant: QuantConfig, gate: float, workdir, fp32_ppl: float) -> None:
    """`mode`'s engine runs quantized and its perplexity increase over fp32 is in (0, gate] (GateNotMet above
    the gate; a mode in REGRESSION fails with a plain AssertionError above its bound)."""
    ppl, engine = _ppl(workdir, mode, quant)
    increase = ppl / fp32_ppl - 1
    print(f"\n{mode}: perplexity {ppl:.4f} vs fp32 {fp32_ppl:.4f} ({100 * increase:+.2f}%)")
    assert_quantized(engine, quant)
    assert increase > 0  # floor: a mode that changes nothing (quantization silently off) fails
    assert increase <= REGRESSION.get(mode, gate), f"{mode}: {100 * increase:+.2f}%, worse than its measurement"
    if increase > gate:
        raise GateNotMet(f"{mode}: {100 * increase:+.2f}% over fp32, gate {100 * gate:.0f}%")


@pytest.mark.parametrize("quant,gate", [v for m, v in MODES.items() if m not in CALIBRATED_MODES],
                         ids=[m for m in MODES if m not in CALIBRATED_MODES])
def test_perplexity_increase_within_gate(quant, gate, workdir, fp32_ppl, request):
    check_gate(request.node.callspec.id, quant, gate, workdir, fp32_ppl)


# --- the same KV scheme in transformers -------------------------------------------------------
# An outside reference for INT8_KV / FP8_KV: HF transformers' LLaMA on the same tokens and
# windows, its K (after RoPE) and V fake-quantized, by the code below (not ours), with the
# per-layer scales our checkpoint calibrated. Our increase must be a draw of HF's (see KV_SEEDS below).
# hf_model: the session's HF transformers SmolLM2 (tests/conftest.py); its attention is set back to sdpa.

KV_QMAX = {"INT8": 127.0, "FP8": 448.0}


def fake_quant(x: torch.Tensor, scale: torch.Tensor, algo: str) -> torch.Tensor:
    """x -> its nearest code of `algo` at `scale`, back in float: int8 round-to-nearest in
    [-127, 127], or float8_e4m3fn of x / scale clamped to +-448."""
    y = (x.float() / scale).clamp(-KV_QMAX[algo], KV_QMAX[algo])
    codes = torch.round(y) if algo == "INT8" else y.to(torch.float8_e4m3fn).float()
    return (codes * scale).to(x.dtype)


def hf_perplexity(model, ids: list[int], window: int = 2048) -> float:
    """exp(mean NLL) of ids under an HF causal LM, window by window (as core.runtime.evaluate)."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window]])  # [1, T]
        with torch.no_grad():
            logits = model(chunk, use_cache=False).logits[0].float()  # [T, V]
        total += torch.nn.functional.cross_entropy(logits[:-1], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return float(torch.tensor(total / count).exp())


def hf_kv_quant_perplexity(model, ids: list[int], scales: list[torch.Tensor], algo: str,
                           seed: int | None = None) -> float:
    """hf_perplexity with every layer's K and V fake-quantized at its (K, V) scales [2]. seed: first
    multiply K and V by (1 + 1e-6 n), n ~ N(0, 1) from that seed (float-rounding-sized noise, the
    size by which two correct float implementations differ after a few layers)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = None if seed is None else torch.Generator().manual_seed(seed)

    def attend(module, query, key, value, attention_mask, **kwargs):  # key, value [B, KVH, T, D]
        k_scale, v_scale = scales[module.layer_idx]
        if gen is not None:
            key = key * (1 + 1e-6 * torch.randn(key.shape, generator=gen))
            value = value * (1 + 1e-6 * torch.randn(value.shape, generator=gen))
        return sdpa_attention_forward(module, query, fake_quant(key, k_scale, algo), fake_quant(value, v_scale, algo),
                                      attention_mask, **kwargs)

    AttentionInterface.register(f"bestiary_kv_{algo}", attend)
    model.set_attn_implementation(f"bestiary_kv_{algo}")
    try:
        return hf_perplexity(model, ids)
    finally:
        model.set_attn_implementation("sdpa")


HF_FLOAT: dict[str, float] = {}

# Why a spread and not one figure: INT8 KV's cost on these 4,096 tokens is set by which codes sit
# on a rounding boundary, so float noise of 1e-6 moves it. transformers' same scheme gave +0.244%
# unperturbed and +0.179 / +0.308 / +0.171% with seeds 1-3; ours +0.168% (2026-11-26: ours and
# transformers' keys agree to ~3e-6 relative and their attention outputs to 2e-6 at layer 0, then
# diverge from layer 1 on through the codes such differences flip). A one-figure match within 25%
# (this test until then) was below that noise, and the INT8 case was a strict xfail for it.
KV_SEEDS = (None, 1, 2, 3)
KV_SIGMAS = 3.0  # ours within 3 standard deviations of transformers' increases (or KV_MATCH of their mean)


@pytest.mark.parametrize("algo", ["INT8", "FP8"])
def test_kv_quant_cost_equals_transformers_same_scheme(algo, workdir, fp32_ppl, hf_model):
    """Our INT8 / FP8 KV perplexity increase is one more draw of HF's with the same scales on the
    same tokens: within KV_SIGMAS standard deviations of HF's increases under float-rounding-sized
    noise (KV_SEEDS), or within KV_MATCH of their mean where they barely spread."""
    name = f"{algo}_KV"
    ppl, engine = _ppl(workdir, name, MODES[name][0])
    ids = engine.tokenizer.encode(eval_text())[:EVAL_TOKENS]
    weights = load_rank_weights(engine.directory, 0)
    layers = hf_model.config.num_hidden_layers
    scales = [weights[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] for i in range(layers)]
    if "ppl" not in HF_FLOAT:
        HF_FLOAT["ppl"] = hf_perplexity(hf_model, ids)
    hf_float = HF_FLOAT["ppl"]
    refs = [hf_kv_quant_perplexity(hf_model, ids, scales, algo, seed) / hf_float - 1 for seed in KV_SEEDS]
    ours = ppl / fp32_ppl - 1
    mean = sum(refs) / len(refs)
    std = (sum((r - mean) ** 2 for r in refs) / (len(refs) - 1)) ** 0.5
    print(f"\n{name}: ours {100 * ours:+.3f}% ({ppl:.4f} / {fp32_ppl:.4f}); transformers same scheme "
          f"{', '.join(f'{100 * r:+.3f}%' for r in refs)} (mean {100 * mean:+.3f}%, std {100 * std:.3f})")
    assert abs(hf_float / fp32_ppl - 1) < 1e-3  # the same model and tokens
    assert all(r > 0 for r in refs) and ours > 0
    assert abs(ours - mean) <= max(KV_SIGMAS * std, KV_MATCH * mean)
