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
from bestiary.core.cli.demo import demo_model_path
from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
from bestiary.core.convert.source_to_checkpoint import convert
from bestiary.core.format.config import QuantConfig
from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.evaluate import perplexity

pytestmark = pytest.mark.slow

EVAL_TOKENS = 4096
TEXT_MODULES = ("argparse", "json", "csv", "statistics", "re", "http.client", "urllib.request", "ssl", "socket",
                "unittest", "heapq", "itertools", "pydoc", "inspect", "doctest", "subprocess", "random", "typing")

INT4_W4A8_NOTE = "W4A8_AWQ g128 (FP8 activations): +71% (docs/quantization.md); the 8% gate is not reached"

# mode -> (quantization section, largest allowed perplexity increase)
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
    # docs/quantization.md): regression gates just above the measurements
    "FP8": (QuantConfig(quant_algo="FP8"), 0.09),
    "W8A8_SQ_a0.5": (QuantConfig(quant_algo="W8A8_SQ_PER_CHANNEL", pre_quant_scale=True), 0.37),
    "W4A8_AWQ_g128": pytest.param(QuantConfig(quant_algo="W4A8_AWQ", group_size=128, pre_quant_scale=True), 0.08,
                                  marks=pytest.mark.xfail(reason=INT4_W4A8_NOTE, strict=True)),
}


def eval_text() -> str:
    """The fixed evaluation text (see the module docstring)."""
    return "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in TEXT_MODULES)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    try:
        gguf = demo_model_path()
    except BestiaryError as err:
        pytest.skip(str(err))
    return tmp_path_factory.mktemp("quant_smollm2"), gguf


def _ppl(workdir, name: str, quant: QuantConfig | None) -> float:
    base, gguf = workdir
    convert(gguf, base / f"{name}-ckpt", dtype="float32", show_progress=False, quantization=quant)
    build_engine(base / f"{name}-ckpt", base / name, BuildConfig(max_seq_len=2048, max_num_tokens=512))
    engine = Engine.load(base / name)
    ids = engine.tokenizer.encode(eval_text())
    assert len(ids) >= EVAL_TOKENS
    return perplexity(engine, ids[:EVAL_TOKENS]).perplexity


@pytest.fixture(scope="module")
def fp32_ppl(workdir):
    return _ppl(workdir, "fp32", None)


@pytest.mark.parametrize("quant,gate", list(MODES.values()), ids=list(MODES))
def test_perplexity_increase_within_gate(quant, gate, workdir, fp32_ppl, request):
    mode = request.node.callspec.id
    ppl = _ppl(workdir, mode, quant)
    increase = ppl / fp32_ppl - 1
    print(f"\n{mode}: perplexity {ppl:.4f} vs fp32 {fp32_ppl:.4f} ({100 * increase:+.2f}%)")
    assert increase <= gate
