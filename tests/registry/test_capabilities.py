"""registry.capabilities: what an architecture declares it takes, as convert refuses it and `bestiary list` shows it."""

from __future__ import annotations

import dataclasses

from bestiary.registry import default_registry
from bestiary.registry.capabilities import columns, refusal


def test_an_architecture_may_take_no_kv_cache_quantization():
    """Supports(kv_cache_quantization=False) (DeepSeek's latent rows): every KV algorithm refused in one line,
    '-' in the list; the default (no list given) takes every one and shows 'all'."""
    deepseek = default_registry().get("DeepseekV2ForCausalLM")
    assert not deepseek.supports.kv_cache_quantization
    assert refusal(deepseek, kv_cache_quant_algo="INT8") == (
        "--int8_kv_cache: DeepseekV2ForCausalLM takes no KV cache quantization (its cache is not plain K / V)")
    assert columns(deepseek)["KV quant"] == "-"
    llama = default_registry().get("LlamaForCausalLM")
    assert refusal(llama, kv_cache_quant_algo="FP8") is None and columns(llama)["KV quant"] == "all"
    only_int8 = dataclasses.replace(llama, supports=dataclasses.replace(llama.supports, kv_cache_quant_algos=("INT8",)))
    assert columns(only_int8)["KV quant"] == "INT8" and str(refusal(only_int8, kv_cache_quant_algo="FP8")) == (
        "--fp8_kv_cache: LlamaForCausalLM supports KV cache quantization INT8")
