"""`bestiary convert --dry_run` (core.convert.lint) and the capability checks of convert / `bestiary list`.

The linter's reason to exist: a square tensor converted with the wrong orientation (here a
LLaMA spec that transposes o_proj, the mirror image of forgetting GPT-2's Conv1D transpose)
converts and runs without any error, its logits off by orders of magnitude more than the
parity bound; the dry run names the tensors.
"""

from __future__ import annotations

import dataclasses
import json

import parity
import pytest
import torch
from safetensors.torch import load_file, save_file

from bestiary.core.cli.main import main
from bestiary.core.convert.lint import lint
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.format.errors import BestiaryError
from bestiary.core.runtime.engine import Engine
from bestiary.registry import Registry, Supports

transformers = pytest.importorskip("transformers")

PROMPT = [3, 17, 42, 5, 88, 9, 61, 23]
TRANSPOSE = "bestiary.core.convert.postprocess:transpose"


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    return parity.reinit_(transformers.LlamaForCausalLM(cfg), 0)


@pytest.fixture(scope="module")
def source(hf_model, tmp_path_factory):
    return parity.save_hf(hf_model, tmp_path_factory.mktemp("lint"))


def registry_with(**changes) -> Registry:
    """A fresh registry whose LLaMA spec has `changes` (postprocess is merged into the spec's)."""
    registry = Registry.from_plugins()
    spec = registry.specs["LlamaForCausalLM"]
    if "postprocess" in changes:
        changes["postprocess"] = {**changes["postprocess"], **spec.postprocess}
    registry.specs[spec.name] = dataclasses.replace(spec, **changes)
    return registry


def test_clean_source_has_no_findings(source):
    report = lint(source, tp_size=2)
    assert report.problems() == []
    rows = {(r.rank, r.target): r for r in report.tensors}
    qkv = rows[(1, "transformer.layers.0.attention.qkv.weight")]
    assert qkv.sources == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert qkv.postprocess.endswith(":concat_dim0") and qkv.tp_slice == "dim 0, part 2 of 2"
    assert rows[(0, "transformer.layers.0.attention.dense.weight")].tp_slice == "dim 1, part 1 of 2"
    assert rows[(0, "transformer.ln_f.weight")].tp_slice == "replicated"
    assert any(n.startswith("reference forward (LlamaForCausalLM") for n in report.notes)


def test_forgotten_transpose_runs_silently_and_is_caught(source, hf_model, tmp_path):
    broken = registry_with(postprocess={"*.attention.dense.weight": TRANSPOSE})  # o_proj is square (64 x 64)
    ckpt = convert(source, tmp_path / "ckpt", registry=broken, show_progress=False)  # no error ...
    ours = parity.EngineRunner(Engine.load(ckpt, registry=broken)).feed(PROMPT, all_logits=True)
    ref = parity.hf_logits(hf_model, PROMPT)
    assert (ours - ref).abs().max().item() > 100 * parity.tolerance(ref)  # ... yet the logits are wrong
    report = lint(source, registry=broken)
    assert report.suspicious == [f"transformer.layers.{i}.attention.dense.weight: transposed? with it transposed, "
                                 f"{'layer 0 output matches' if i == 0 else 'the logits match'} the reference"
                                 for i in range(2)]
    assert report.missing == report.unused == report.shape_errors == []


def test_missing_unused_and_shape_errors_are_collected(source, tmp_path):
    weights = load_file(str(source / "model.safetensors"))
    weights["extra.weight"] = torch.ones(2)
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:-1]
    del weights["model.norm.weight"]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(weights, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((source / "config.json").read_text())
    report = lint(bad)
    assert report.missing == ["transformer.ln_f.weight: model.norm.weight"]
    assert report.unused == ["extra.weight"]
    assert len(report.shape_errors) == 1 and "model.layers.1.mlp.up_proj.weight" in report.shape_errors[0]
    assert len(report.problems()) == 3


def test_cli_dry_run_writes_only_the_report(source, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["convert", "--model_dir", str(source), "--dry_run", "--report", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["problems"] == [] and data["architecture"] == "LlamaForCausalLM"
    assert {"target", "sources", "postprocess", "tp_slice"} <= set(data["tensors"][0])
    assert "transformer.layers.1.attention.qkv.weight" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no checkpoint written


def test_unsupported_options_are_refused_before_weights_are_read(source, tmp_path, monkeypatch):
    """A spec without tensor parallelism or W4A16: refused before the loader reads any tensor."""
    from bestiary.core.format.config import QuantConfig
    from bestiary.core.sources.safetensors_source import SafetensorsWeights

    def no_reading(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(SafetensorsWeights, "load", no_reading)
    registry = registry_with(supports=Supports(tensor_parallel=False, quant_algos=("W8A16",)))
    with pytest.raises(BestiaryError, match="--tp_size 2: LlamaForCausalLM does not support tensor parallelism"):
        convert(source, tmp_path / "a", ConvertOptions(tp_size=2), registry=registry, show_progress=False)
    with pytest.raises(BestiaryError, match="quantization W4A16: LlamaForCausalLM supports W8A16"):
        convert(source, tmp_path / "b", ConvertOptions(quantization=QuantConfig(quant_algo="W4A16")), registry=registry,
                show_progress=False)
    with pytest.raises(BestiaryError, match="--tp_size 2: LlamaForCausalLM does not support"):
        lint(source, tp_size=2, registry=registry)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_list_shows_capabilities(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "architecture" in line and "sources" in line)
    for column in ("TP", "PP", "EP", "quant", "KV quant", "sources"):
        assert column in header
    llama = next(line for line in out.splitlines() if line.lstrip("│ ").startswith("LlamaForCausalLM"))
    assert "hf, gguf" in llama
