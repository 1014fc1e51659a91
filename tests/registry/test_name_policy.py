"""The name policy (registry.name_policy): a third-party plugin registering a name bestiary has built in.

Each test installs a fake third-party distribution (a `.dist-info` with an entry point in the
`bestiary.architectures` group and its module, on sys.path): what `pip install bestiary-qwen3` would leave.
Before the policy, a plugin under its own entry-point name stopped every command at start-up
(DuplicateArchitectureError, `bestiary list` exit 2), and one whose entry point was named like the
built-in's (`qwen3`) silently replaced it or was silently ignored, by sys.path order.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from bestiary.core.format.errors import BestiaryError
from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec, DuplicateArchitectureError, Registry
from bestiary.registry.name_policy import PREFER_ENV

DIST = "bestiary-qwen3-fake"
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}

PLUGIN = '''
from bestiary.plugins import hookimpl
from bestiary.registry import ArchitectureSpec

SPEC = ArchitectureSpec(
    name={name!r}, hf_architectures=("Qwen3ForCausalLM",), hf_model_types=("qwen3",),
    config_class="bestiary.models.qwen3.model:Qwen3Config", model_class="bestiary.models.qwen3.model:Qwen3ForCausalLM",
    from_hf_config="bestiary.models.qwen3.model:from_hf_config", description="third-party Qwen3")


@hookimpl
def bestiary_register_architectures(register):
    register(SPEC)
'''


def install_fake(site: Path, entry_point: str, name: str = "Qwen3ForCausalLM", module: str = "fake_qwen3") -> Path:
    """A fake installed distribution DIST under `site`: entry point `entry_point = module`, registering `name`."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(PLUGIN.format(name=name))
    info = site / "bestiary_qwen3_fake-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[bestiary.architectures]\n{entry_point} = {module}\n")
    return site


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """Install the fake distribution (entry point given by the test) on sys.path."""
    def install(entry_point: str, **kw: str) -> Path:
        site = install_fake(tmp_path / "site", entry_point, **kw)
        monkeypatch.syspath_prepend(str(site))
        return site

    monkeypatch.delenv(PREFER_ENV, raising=False)
    yield install
    for module in [m for m in sys.modules if m.startswith("fake_qwen3")]:
        del sys.modules[module]


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("bestiary: warning:")]


@pytest.mark.parametrize("entry_point", ["qwen3", "bestiary_qwen3"])
def test_builtin_wins_with_one_warning_naming_the_distribution(fake_site, capsys, entry_point):
    """Entry point named like the built-in's (`qwen3`) or its own: the built-in serves the name and the
    source configs, the plugin is loaded (not skipped) and named in one warning line."""
    fake_site(entry_point)
    registry = Registry.from_plugins()
    assert registry.get("Qwen3ForCausalLM").package == "bestiary"
    assert registry.for_hf_config(QWEN3, "c").package == "bestiary"
    assert DIST in registry.plugins.packages.values()  # loaded, then set aside under the policy
    (shadow,) = registry.shadowed
    assert (shadow.kept.package, shadow.dropped.package) == ("bestiary", DIST)
    (line,) = warnings_of(capsys.readouterr().err)
    assert DIST in line and "Qwen3ForCausalLM" in line and f"{PREFER_ENV}={DIST}" in line


@pytest.mark.parametrize("entry_point", ["qwen3", "bestiary_qwen3"])
def test_the_plugin_wins_when_the_user_asks(fake_site, capsys, monkeypatch, entry_point):
    """BESTIARY_PREFER_PLUGINS=<distribution> (or the entry-point name): the plugin's spec serves the name
    and the source configs, without a warning (the user asked)."""
    fake_site(entry_point)
    for prefer in (DIST, entry_point):
        monkeypatch.setenv(PREFER_ENV, f" other , {prefer}")
        registry = Registry.from_plugins()
        assert registry.get("Qwen3ForCausalLM").package == DIST
        assert registry.for_hf_config(QWEN3, "c").description == "third-party Qwen3"
        assert "Qwen2ForCausalLM" in registry.names()  # the other built-ins stay
    assert warnings_of(capsys.readouterr().err) == []


def test_a_plugin_claiming_a_builtin_hf_architecture_under_its_own_name(fake_site, capsys, monkeypatch):
    """A plugin spec `MyQwen3ForCausalLM` claiming HF Qwen3ForCausalLM: both are registered; sources naming
    Qwen3ForCausalLM convert as the built-in (one warning line naming the plugin), or as the plugin's when
    preferred or picked with --architecture."""
    fake_site("my_qwen3", name="MyQwen3ForCausalLM")
    registry = Registry.from_plugins()
    assert {"Qwen3ForCausalLM", "MyQwen3ForCausalLM"} <= set(registry.names())
    assert registry.for_hf_config(QWEN3, "c").name == "Qwen3ForCausalLM"
    assert registry.for_hf_config(QWEN3, "c", override="MyQwen3ForCausalLM").package == DIST
    (line,) = warnings_of(capsys.readouterr().err)
    assert DIST in line and "MyQwen3ForCausalLM" in line and "--architecture MyQwen3ForCausalLM" in line
    monkeypatch.setenv(PREFER_ENV, DIST)
    assert Registry.from_plugins().for_hf_config(QWEN3, "c").name == "MyQwen3ForCausalLM"
    assert warnings_of(capsys.readouterr().err) == []


def test_bestiary_list_starts_and_names_the_plugin(tmp_path):
    """`bestiary list` with the plugin installed: exit 0, the built-in listed, one warning line on stderr;
    with the preference, the plugin's package in the table and no warning."""
    site = install_fake(tmp_path / "site", "qwen3")
    env = {k: v for k, v in os.environ.items() if k != PREFER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    env["COLUMNS"] = "400"  # one table row per architecture
    for prefer, package in ((None, "bestiary"), (DIST, DIST)):
        run_env = env | ({PREFER_ENV: prefer} if prefer else {})
        done = subprocess.run([sys.executable, "-m", "bestiary", "list"], capture_output=True, text=True,
                              env=run_env, timeout=120)
        assert done.returncode == 0, done.stderr
        (row,) = [line for line in done.stdout.splitlines() if "Qwen3ForCausalLM " in line and "qwen3 " in line]
        assert row.split("│")[2].strip() == package, row
        assert len(warnings_of(done.stderr)) == (0 if prefer else 1), done.stderr
        assert "Traceback" not in done.stderr


def plugin(name: str, description: str) -> types.SimpleNamespace:
    """An in-process plugin object registering `name` (LLaMA's code)."""
    def register(register):
        register(ArchitectureSpec(name=name, description=description,
                                  config_class="bestiary.models.llama.model:LlamaConfig",
                                  model_class="bestiary.models.llama.model:LlamaForCausalLM",
                                  from_hf_config="bestiary.models.llama.model:from_hf_config"))

    return types.SimpleNamespace(bestiary_register_architectures=hookimpl(register))


def test_two_third_party_plugins_one_name(capsys):
    """Neither built in: the first loaded keeps the name (a warning names both), unless the other is preferred."""
    extra = {"first": plugin("ToyForCausalLM", "one"), "second": plugin("ToyForCausalLM", "two")}
    registry = Registry.from_plugins(extra, prefer=frozenset())
    assert registry.get("ToyForCausalLM").description == "one"
    (line,) = warnings_of(capsys.readouterr().err)
    assert "'second'" in line and "'first'" in line and f"{PREFER_ENV}=second" in line
    assert Registry.from_plugins(extra, prefer=frozenset({"second"})).get("ToyForCausalLM").description == "two"
    assert warnings_of(capsys.readouterr().err) == []


def test_one_plugin_registering_a_name_twice_is_its_failure_not_a_crash():
    """A plugin bug (the same name twice) is recorded as that plugin's one-line failure; the rest load."""
    def twice(register):
        for _ in range(2):
            register(ArchitectureSpec(name="TwiceForCausalLM", config_class="bestiary.models.llama.model:LlamaConfig",
                                      model_class="bestiary.models.llama.model:LlamaForCausalLM",
                                      from_hf_config="bestiary.models.llama.model:from_hf_config"))

    registry = Registry.from_plugins({"twice": types.SimpleNamespace(bestiary_register_architectures=hookimpl(twice))})
    (failure,) = [f for f in registry.failures if f.name == "twice"]
    assert "registered twice" in failure.traceback and len(failure.traceback.splitlines()) == 1
    assert "LlamaForCausalLM" in registry.names()
    with pytest.raises(DuplicateArchitectureError):  # register() called directly keeps its strict contract
        registry.register(registry.get("LlamaForCausalLM"), "someone")
    assert issubclass(DuplicateArchitectureError, BestiaryError)


def test_other_ranks_stay_quiet(monkeypatch, capsys):
    """Rank 0 prints the registry's warnings; spawned ranks (processes named bestiary-rank{r} by
    core.runtime.worker_group) and torchrun ranks > 0 do not (a tp 2 `bestiary run` printed each twice)."""
    import multiprocessing

    from bestiary.core.runtime import worker_group
    from bestiary.registry.name_policy import warn

    assert 'name=f"bestiary-rank{rank}"' in Path(worker_group.__file__).read_text()  # the name warn() looks for
    warn("rank 0 says it")
    monkeypatch.setattr(multiprocessing.current_process(), "name", "bestiary-rank1")
    warn("a spawned rank does not")
    monkeypatch.setattr(multiprocessing.current_process(), "name", "MainProcess")
    monkeypatch.setenv("RANK", "1")
    warn("a torchrun rank does not")
    assert warnings_of(capsys.readouterr().err) == ["bestiary: warning: rank 0 says it"]
