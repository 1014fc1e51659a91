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

import pytest
import torch
from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
from bestiary.core.convert.source_to_checkpoint import convert
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

INT4_W4A8_NOTE = "W4A8_AWQ g128 (FP8 activations): +71% (docs/quantization.md); the 8% gate is not reached"

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
#   INT8_KV 1%, FP8_KV 2%: not yet checked against an outside reference (llama.cpp's q8_0 KV
#     cache would be one); kept as first set.
#   W4A16 8%: the int4 target of the quantization issue. llama.cpp's Q4_0 (no zero point) gives
#     +22.9% here and is no reference for zero-point int4 (the Q4_1 grid does not survive it).
#   FP8 9%, W8A8_SQ 37%: regression gates just above this code's own measurements (+6.8%, +35%);
#     no outside reference with static per-tensor activation scales is at hand (llama.cpp
#     quantizes activations per block of 32 at run time). 30% -> 37% when the built-in
#     calibration text grew (wider static activation ranges, commit 1e1fd15).
MODES = {
    "W8A16": (QuantConfig(quant_algo="W8A16"), 0.01),
    "INT8_KV": (QuantConfig(kv_cache_quant_algo="INT8"), 0.01),
    "FP8_KV": (QuantConfig(kv_cache_quant_algo="FP8"), 0.02),
    # int4: zero points, lm_head float (`--exclude_modules lm_head`, TensorRT-LLM's and AutoAWQ's default)
    "W4A16_g64_zp": (QuantConfig(quant_algo="W4A16", group_size=64, has_zero_point=True,
                                 exclude_modules=["lm_head"]), 0.08),
    "W4A16_g128_zp": (QuantConfig(quant_algo="W4A16", group_size=128, has_zero_point=True,
                                  exclude_modules=["lm_head"]), 0.08),
    # activation-quantized (static per-tensor activation scales; measured +6.8% / +35% / +71%,
    # docs/quantization.md): regression gates just above the measurements (see above)
    "FP8": (QuantConfig(quant_algo="FP8"), 0.09),
    "W8A8_SQ_a0.5": (QuantConfig(quant_algo="W8A8_SQ_PER_CHANNEL", pre_quant_scale=True), 0.37),
    "W4A8_AWQ_g128": pytest.param(QuantConfig(quant_algo="W4A8_AWQ", group_size=128, pre_quant_scale=True), 0.08,
                                  marks=pytest.mark.xfail(reason=INT4_W4A8_NOTE, strict=True)),
}


def eval_text() -> str:
    """The fixed evaluation text (see the module docstring)."""
    return "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in TEXT_MODULES)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, smollm2_gguf):
    return tmp_path_factory.mktemp("quant_smollm2"), smollm2_gguf


def _ppl(workdir, name: str, quant: QuantConfig | None) -> tuple[float, Engine]:
    base, gguf = workdir
    convert(gguf, base / f"{name}-ckpt", dtype="float32", show_progress=False, quantization=quant)
    build_engine(base / f"{name}-ckpt", base / name, BuildConfig(max_seq_len=2048, max_num_tokens=512))
    engine = Engine.load(base / name)
    ids = engine.tokenizer.encode(eval_text())
    assert len(ids) >= EVAL_TOKENS
    return perplexity(engine, ids[:EVAL_TOKENS]).perplexity, engine


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
def fp32_ppl(workdir):
    return _ppl(workdir, "fp32", None)[0]


@pytest.mark.parametrize("quant,gate", list(MODES.values()), ids=list(MODES))
def test_perplexity_increase_within_gate(quant, gate, workdir, fp32_ppl, request):
    mode = request.node.callspec.id
    ppl, engine = _ppl(workdir, mode, quant)
    increase = ppl / fp32_ppl - 1
    print(f"\n{mode}: perplexity {ppl:.4f} vs fp32 {fp32_ppl:.4f} ({100 * increase:+.2f}%)")
    assert_quantized(engine, quant)
    assert increase > 0  # floor: a mode that changes nothing (quantization silently off) fails
    assert increase <= gate
