"""The plugin system and the architecture registry."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from bestiary.core.format.errors import BestiaryError
from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, DuplicateArchitectureError, Registry


def plugin(**hooks) -> types.SimpleNamespace:
    """A plugin object with the given hook implementations."""
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def spec(name: str, **kw) -> ArchitectureSpec:
    """A spec whose lazy references exist (they are checked at registration): LLaMA's code."""
    refs = dict(config_class="bestiary.models.llama.model:LlamaConfig",
                model_class="bestiary.models.llama.model:LlamaForCausalLM",
                from_hf_config="bestiary.models.llama.model:from_hf_config")
    return ArchitectureSpec(name=name, **{**refs, **kw})


@pytest.mark.parametrize("field,ref,words", [
    ("model_class", "bestiary.models.llama.model:LlamaForCausalLMM", ["model_class", "has no attribute"]),
    ("config_class", "bestiary.models.llama.confg:LlamaConfig", ["config_class", "no module named"]),
    ("from_hf_config", "bestiary.models.llama.model.from_hf_config", ["from_hf_config", "must look like"]),
])
def test_a_reference_typo_is_refused_at_registration_in_one_line(field, ref, words):
    """It used to pass registration and fail at convert with a 22-line AttributeError."""
    def typo(register):
        register(spec("TypoForCausalLM", hf_architectures=("TypoForCausalLM",), **{field: ref}))

    registry = Registry.from_plugins({"typo": plugin(bestiary_register_architectures=typo)})
    (failure,) = [f for f in registry.failures if f.name == "typo"]
    assert "Traceback" not in failure.traceback and len(failure.traceback.splitlines()) == 1
    assert all(w in failure.traceback for w in ["TypoForCausalLM", ref, *words]), failure.traceback
    with pytest.raises(BestiaryError, match="plugin 'typo' failed to load: .*" + words[-1]):
        registry.for_hf_config({"architectures": ["TypoForCausalLM"]}, "c/config.json")


def test_resolve_typo_is_one_line():
    from bestiary.core.format.errors import PluginError
    from bestiary.registry import resolve

    with pytest.raises(PluginError, match="has no attribute 'nope'"):
        resolve("bestiary.models.llama.model:nope")


def test_builtin_llama_registered_through_entry_point():
    registry = Registry.from_plugins()
    llama = registry.get("LlamaForCausalLM")
    assert llama.package == "bestiary"
    assert "llama" in llama.hf_model_types
    assert "llama" in registry.plugins.packages


def test_broken_plugin_is_reported_and_others_keep_working():
    def broken(register):
        raise RuntimeError("plugin exploded on purpose")

    registry = Registry.from_plugins({"broken": plugin(bestiary_register_architectures=broken)})
    assert "LlamaForCausalLM" in registry.names()
    (failure,) = [f for f in registry.failures if f.name == "broken"]
    assert "plugin exploded on purpose" in failure.traceback and "Traceback" in failure.traceback


def test_duplicate_name_keeps_the_builtin_and_names_both_packages(capsys):
    """The name policy (tests/registry/test_name_policy.py): no crash, the built-in stays, one warning line."""
    def twice(register):
        register(spec("LlamaForCausalLM", description="dup"))

    registry = Registry.from_plugins({"dup": plugin(bestiary_register_architectures=twice)}, prefer=frozenset())
    assert registry.get("LlamaForCausalLM").package == "bestiary"
    (line,) = capsys.readouterr().err.splitlines()
    assert "'dup'" in line and "built in" in line
    with pytest.raises(DuplicateArchitectureError, match="registered twice.*bestiary"):
        registry.register(spec("LlamaForCausalLM"), "dup")  # register() itself stays strict


def test_override_replaces_an_installed_spec_only_for_the_plugins_given():
    """local_registry's rule (a plugin package under test wins over the installed spec of its name)."""
    def mine(register):
        register(spec("LlamaForCausalLM", description="mine"))

    registry = Registry.from_plugins({"mine": plugin(bestiary_register_architectures=mine)}, override=True)
    assert registry.get("LlamaForCausalLM").description == "mine"
    assert "OPTForCausalLM" in registry.names()  # the other built-ins stay
    plain = Registry.from_plugins({"mine": plugin(bestiary_register_architectures=mine)}, prefer=frozenset())
    assert plain.get("LlamaForCausalLM").package == "bestiary"  # without override the built-in wins


def test_lookup_by_hf_architecture_and_model_type():
    registry = Registry.from_plugins()
    assert registry.for_hf_config({"architectures": ["LlamaForCausalLM"]}, "c").name == "LlamaForCausalLM"
    assert registry.for_hf_config({"model_type": "llama"}, "c").name == "LlamaForCausalLM"


def test_unknown_architecture_lists_registered_ones():
    registry = Registry.from_plugins()
    with pytest.raises(BestiaryError, match=r"c/config.json: unknown architecture MambaLM; registered: .*Llama"):
        registry.for_hf_config({"architectures": ["MambaLM"]}, "c/config.json")


def test_claim_hook_and_conflict():
    def reg(register):
        register(spec("ToyA"))
        register(spec("ToyB"))

    claims_a = plugin(bestiary_register_architectures=reg,
                      bestiary_claim_hf_config=lambda hf_config: "ToyA" if hf_config.get("toy") else None)
    registry = Registry.from_plugins({"toys": claims_a})
    assert registry.for_hf_config({"toy": 1, "model_type": "llama"}, "c").name == "ToyA"
    assert registry.for_hf_config({"toy": 1}, "c", override="ToyB").name == "ToyB"
    claims_b = plugin(bestiary_claim_hf_config=lambda hf_config: "ToyB" if hf_config.get("toy") else None)
    registry = Registry.from_plugins({"toys": claims_a, "other": claims_b})
    with pytest.raises(BestiaryError, match="'ToyA' and 'ToyB' both claim"):
        registry.for_hf_config({"toy": 1}, "c")


def test_list_imports_no_torch():
    """`bestiary list` and `--help` stay light: no torch, no triton."""
    code = (
        "import sys; from bestiary.core.cli.main import main; main(['list']);"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
