"""Every built-in family has one shape, the one docs/add-an-architecture.md teaches (issue: one shape
for every family): the same files, a DecoderConfig read by hf_config_reader, layers from
standard_layer, a model docstring with the formula, and docs/models.md's line counts kept true."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from bestiary.core.format.hf_config import DecoderConfig
from bestiary.core.runtime.model import DecoderLM
from bestiary.registry import default_registry

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from family_lines import family_lines  # noqa: E402

MODELS = REPO / "models"
FAMILIES = sorted(p.name for p in MODELS.iterdir() if (p / "__init__.py").exists())
FILES = ("__init__.py", "model.py")  # and weights.py, only with the family's own postprocess hooks
BUILT_IN = [s for s in default_registry().specs.values() if s.model_class.startswith("bestiary.models.")]


@pytest.mark.parametrize("family", FAMILIES)
def test_same_files_in_every_family(family):
    files = sorted(p.name for p in (MODELS / family).glob("*.py"))
    extra = set(files) - set(FILES) - {"weights.py"}
    assert set(FILES) <= set(files) and not extra, f"models/{family}: {files}"
    if "weights.py" in files:  # holds hooks the spec names
        assert f"bestiary.models.{family}.weights" in (MODELS / family / "__init__.py").read_text()


@pytest.mark.parametrize("family", FAMILIES)
def test_model_module_states_the_formula_and_builds_with_standard_layer(family):
    source = (MODELS / family / "model.py").read_text()
    tree = ast.parse(source)
    doc = ast.get_docstring(tree) or ""
    for lhs in ("x", "logits"):  # end to end: from the embedding to the logits
        assert re.search(rf"^\s*{lhs}\s+=", doc, re.M), f"models/{family}/model.py: its formula has no '{lhs} ='"
    makers = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "make_layer"]
    assert makers
    for maker in makers:
        calls = {c.func.id for c in ast.walk(maker) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        assert "standard_layer" in calls, f"models/{family}/model.py: make_layer does not call standard_layer"


@pytest.mark.parametrize("spec", BUILT_IN, ids=lambda s: s.name)
def test_configs_are_decoder_configs_read_in_one_place(spec):
    module, _, name = spec.config_class.partition(":")
    config = getattr(importlib.import_module(module), name)
    assert issubclass(config, DecoderConfig)
    model_module, _, model_name = spec.model_class.partition(":")
    assert issubclass(getattr(importlib.import_module(model_module), model_name), DecoderLM)
    assert spec.from_hf_config.startswith(f"{model_module}:"), spec.from_hf_config


def test_no_family_parses_rope_itself():
    """RoPE fields are read by core.format.hf_config.read_rope only."""
    for path in MODELS.rglob("*.py"):
        text = path.read_text()
        assert "rope_scaling" not in text and "rope_parameters" not in text, path


def test_mistral_is_an_alias_of_llama():
    spec = default_registry().get("MistralForCausalLM")
    assert spec.name == "LlamaForCausalLM" and "mistral" in spec.hf_model_types
    assert not (MODELS / "mistral").exists()


def test_docs_line_counts_are_the_code():
    """docs/models.md's "after" column is what benchmarks/family_lines.py counts now."""
    text = (REPO / "docs" / "models.md").read_text()
    table = text.split("<!-- family-lines -->")[1].split("<!-- /family-lines -->")[0]
    shown = dict(re.findall(r"^\| `(\w+)` \| [^|]+\| (\d+ \+ \d+ \(\d+ files?\)) \|$", table, re.M))
    counted = {name: f"{c} + {i} ({n} files)" for name, (c, i, n) in family_lines(MODELS).items()}
    assert shown == counted


@pytest.mark.parametrize("spec", BUILT_IN, ids=lambda s: s.name)
def test_a_familys_own_hooks_live_in_its_weights_module(spec):
    """Postprocess hooks are core's (bestiary.core.*) or the family's weights.py, never model.py."""
    family = spec.model_class.split(":")[0].rsplit(".", 1)[0]
    for target in spec.postprocess.values():
        module = target.split(":")[0]
        assert module.startswith("bestiary.core.") or module == f"{family}.weights", target
