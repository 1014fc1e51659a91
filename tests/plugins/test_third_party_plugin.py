"""The worked example of docs/add-an-architecture.md, run as a third-party plugin.

tests/data/tinygpt_plugin/ is the package the doc shows (TinyGPT: LLaMA with LayerNorm and a
GELU MLP). Its module is imported by path, without a pip install, and registered with
`Registry.from_plugins`; a tiny random TinyGPT checkpoint is converted and run through it and
compared with a plain-torch reference forward. The broken variant (the plugin's qkv
postprocess hook left out) must miss the tolerance by 100x.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import parity
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.errors import WeightsError
from bestiary.core.runtime.engine import Engine
from bestiary.core.runtime.llm import LLM
from bestiary.core.runtime.sampling import SamplingConfig
from bestiary.registry import Registry

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "data" / "tinygpt_plugin" / "bestiary_tinygpt"
NAME = "TinyGPTForCausalLM"
# TinyGPT's own config.json: no `architectures`/`model_type`, the plugin's claim hook picks it up.
SOURCE_CONFIG = {"arch": "tinygpt", "vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "ffn_dim": 48,
                 "max_seq_len": 128, "norm_eps": 1e-5, "rope_theta": 10000.0}
PROMPT = [1, 2, 3, 4, 9, 10, 11, 12, 13, 40, 41, 7]


@pytest.fixture(scope="module")
def plugin():
    """The bestiary_tinygpt package, imported from its directory (no pip install)."""
    spec = importlib.util.spec_from_file_location(
        "bestiary_tinygpt", PLUGIN_DIR / "__init__.py", submodule_search_locations=[str(PLUGIN_DIR)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bestiary_tinygpt"] = module  # the spec's "bestiary_tinygpt.model:..." references resolve here
    spec.loader.exec_module(module)
    yield module
    for name in [n for n in sys.modules if n == "bestiary_tinygpt" or n.startswith("bestiary_tinygpt.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def registry(plugin) -> Registry:
    return Registry.from_plugins({"tinygpt": plugin})


def make_source(directory: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random TinyGPT checkpoint in TinyGPT's naming: config.json + model.safetensors."""
    gen = torch.Generator().manual_seed(seed)
    c = SOURCE_CONFIG
    hidden, vocab, inter = c["dim"], c["vocab_size"], c["ffn_dim"]

    def mat(*shape):  # N(0, 1/fan_in)
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    def bias(n):
        return 0.1 * torch.randn(n, generator=gen)

    w = {"tok_embeddings.weight": torch.randn(vocab, hidden, generator=gen),
         "norm.weight": norm(hidden), "norm.bias": bias(hidden), "output.weight": mat(vocab, hidden)}
    for i in range(c["n_layers"]):
        p = f"layers.{i}."
        w |= {p + "attn_norm.weight": norm(hidden), p + "attn_norm.bias": bias(hidden),
              p + "attn.wqkv.weight": mat(3 * hidden, hidden), p + "attn.wqkv.bias": bias(3 * hidden),
              p + "attn.wo.weight": mat(hidden, hidden), p + "attn.wo.bias": bias(hidden),
              p + "ffn_norm.weight": norm(hidden), p + "ffn_norm.bias": bias(hidden),
              p + "ffn.up.weight": mat(inter, hidden), p + "ffn.up.bias": bias(inter),
              p + "ffn.down.weight": mat(hidden, inter), p + "ffn.down.bias": bias(hidden)}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(w, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(SOURCE_CONFIG))
    return w


def rope_neox(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, h, D] rotated by position t: halves (a, b) -> (a cos - b sin, b cos + a sin)."""
    t, _, d = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)  # [D/2]
    angles = torch.arange(t).float()[:, None] * inv_freq[None]  # [T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [T, 1, D/2]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_logits(w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """TinyGPT's forward in plain torch, on the source tensors: logits [T, V]."""
    c = SOURCE_CONFIG
    hidden, heads, eps = c["dim"], c["n_heads"], c["norm_eps"]
    d, t = hidden // heads, len(ids)

    def ln(x, name):
        return F.layer_norm(x, (hidden,), w[name + ".weight"], w[name + ".bias"], eps)

    def linear(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    x = w["tok_embeddings.weight"][torch.tensor(ids)]  # [T, H]
    for i in range(c["n_layers"]):
        p = f"layers.{i}."
        qkv = linear(ln(x, p + "attn_norm"), p + "attn.wqkv").view(t, heads, 3, d)  # per-head q, k, v
        q, k = rope_neox(qkv[:, :, 0], c["rope_theta"]), rope_neox(qkv[:, :, 1], c["rope_theta"])
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), qkv[:, :, 2].transpose(0, 1),
                                             is_causal=True)  # [h, T, D]
        x = x + linear(att.transpose(0, 1).reshape(t, hidden), p + "attn.wo")
        x = x + linear(F.gelu(linear(ln(x, p + "ffn_norm"), p + "ffn.up")), p + "ffn.down")
    return ln(x, "norm") @ w["output.weight"].T


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("tinygpt") / "src"
    return directory, make_source(directory)


def test_plugin_registers_and_claims_its_config(registry, plugin):
    spec = registry.get(NAME)
    assert spec.package == "bestiary_tinygpt"
    assert registry.for_hf_config(SOURCE_CONFIG, "config.json") is spec  # through bestiary_claim_hf_config
    assert registry.for_hf_config({"architectures": [NAME]}, "config.json") is spec


def test_convert_and_run_match_reference(registry, source, tmp_path):
    src, weights = source
    ckpt = convert(src, tmp_path / "ckpt", registry=registry, show_progress=False)
    engine = Engine.load(ckpt, registry=registry)
    ours = parity.EngineRunner(engine).feed(PROMPT, all_logits=True)
    ref = reference_logits(weights, PROMPT)
    assert (ours - ref).abs().max().item() <= parity.tolerance(ref)

    llm = LLM(ckpt, registry=registry)
    (completion,) = llm.generate([PROMPT], SamplingConfig(max_new_tokens=6, temperature=0.0))
    seq = list(PROMPT)
    for _ in range(6):
        seq.append(int(reference_logits(weights, seq)[-1].argmax()))
    assert completion.output_ids == seq[len(PROMPT):]


def test_without_qkv_hook_misses(registry, source, tmp_path):
    """Broken variant: the per-head -> [Q; K; V] reorder left out (identity postprocess)."""
    src, weights = source
    broken = Registry.from_plugins({"tinygpt": sys.modules["bestiary_tinygpt"]})
    broken.specs[NAME] = dataclasses.replace(broken.specs[NAME], postprocess={})
    ckpt = convert(src, tmp_path / "ckpt", registry=broken, show_progress=False)
    ours = parity.EngineRunner(Engine.load(ckpt, registry=broken)).feed(PROMPT, all_logits=True)
    ref = reference_logits(weights, PROMPT)
    assert (ours - ref).abs().max().item() > 100 * parity.tolerance(ref)


def test_tensor_parallel_ranks_get_their_heads(registry, source, tmp_path):
    """The hook sees rows already cut for the rank: rank 1 of 2 holds heads 2..3 of Q, K and V."""
    src, _ = source
    whole = load_file(str(convert(src, tmp_path / "tp1", registry=registry, show_progress=False)
                          / "rank0.safetensors"))
    rank1 = load_file(str(convert(src, tmp_path / "tp2", ConvertOptions(tp_size=2), registry=registry,
                                  show_progress=False)
                          / "rank1.safetensors"))
    for kind in ("weight", "bias"):
        key = f"transformer.layers.0.attention.qkv.{kind}"
        q, k, v = whole[key].chunk(3)  # [H*D, ...] each
        half = q.shape[0] // 2
        assert torch.equal(rank1[key], torch.cat([q[half:], k[half:], v[half:]]))


def test_unused_source_tensor_is_an_error(registry, source, tmp_path):
    _, weights = source
    extra = tmp_path / "extra"
    extra.mkdir()
    save_file(weights | {"layers.0.attn.rotary.inv_freq": torch.ones(4)}, str(extra / "model.safetensors"))
    (extra / "config.json").write_text(json.dumps(SOURCE_CONFIG))
    with pytest.raises(WeightsError, match="layers.0.attn.rotary.inv_freq"):
        convert(extra, tmp_path / "ckpt", registry=registry, show_progress=False)
