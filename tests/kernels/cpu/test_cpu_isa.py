"""Which build of the CPU kernels runs: chosen from the CPU's flags, forced by BESTIARY_CPU_ISA,
refused (one line, exit 2) for an ISA the CPU lacks, shown by `bestiary inspect`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bestiary.core.format.errors import BestiaryError
from bestiary.core.kernels.cpu import build

AVX2_LAPTOP = frozenset({"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "fma", "f16c", "avx2", "bmi1", "bmi2"})
AVX512_SERVER = AVX2_LAPTOP | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
BF16_SERVER = AVX512_SERVER | {"avx512_bf16"}  # Cooper Lake, Sapphire Rapids, Zen 4


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a CPU with the given /proc/cpuinfo flags (x86); fresh library caches."""
    def pretend(flags: frozenset[str], capability: str = "") -> None:
        monkeypatch.setattr(build, "cpu_flags", lambda: flags)
        monkeypatch.setattr(build, "torch_capability", lambda: capability)
        monkeypatch.setattr(build, "x86", lambda: True)
    monkeypatch.delenv(build.ISA_ENV_VAR, raising=False)
    build.library.cache_clear()
    yield pretend
    build.library.cache_clear()


def test_best_isa_the_flags_allow(cpu):
    cpu(AVX512_SERVER)
    assert build.supported_isas() == ["avx512", "avx2", "scalar"] and build.chosen_isa() == "avx512"
    cpu(AVX2_LAPTOP)
    assert build.supported_isas() == ["avx2", "scalar"] and build.chosen_isa() == "avx2"
    cpu(AVX2_LAPTOP - {"f16c"})  # AVX2 without F16C: not the AVX2 build
    assert build.chosen_isa() == "scalar"
    cpu(AVX2_LAPTOP | {"avx512f"})  # AVX-512 foundation without BW / VL: AVX2
    assert build.chosen_isa() == "avx2"


def test_avx512_bf16_selects_the_dot_product_build(cpu, monkeypatch):
    """avx512_bf16 and avx512_vnni present: the avx512bf16 build (vdpbf16ps, vpdpwssd); forced avx512
    still loads the plain AVX-512 one; a CPU without the flag refuses avx512bf16 naming it.
    describe() lists the extras the chosen build does not use."""
    cpu(BF16_SERVER)
    assert build.supported_isas() == ["avx512bf16", "avx512", "avx2", "scalar"]
    assert build.chosen_isa() == "avx512bf16"
    assert build.describe()["cpu extras"] == "-"  # avx512_bf16 and avx512_vnni are in use
    cpu(BF16_SERVER - {"avx512_vnni"})  # no such CPU is known, but the build needs both
    assert build.supported_isas() == ["avx512", "avx2", "scalar"]
    cpu(BF16_SERVER)
    monkeypatch.setenv(build.ISA_ENV_VAR, "avx512")
    assert build.chosen_isa() == "avx512" and build.describe()["cpu extras"] == "avx512_vnni, avx512_bf16"
    cpu(AVX512_SERVER)
    monkeypatch.setenv(build.ISA_ENV_VAR, "avx512bf16")
    with pytest.raises(BestiaryError, match=r"ISA=avx512bf16: this CPU lacks avx512_bf16 \(/proc"):
        build.chosen_isa()
    cpu(BF16_SERVER - {"avx512vl"})  # BF16 without VL: neither AVX-512 build
    monkeypatch.delenv(build.ISA_ENV_VAR)
    assert build.supported_isas() == ["avx2", "scalar"]


def test_no_cpuinfo_falls_back_on_torch_capability(cpu):
    cpu(frozenset(), "AVX2")
    assert build.supported_isas() == ["avx2", "scalar"]
    cpu(frozenset(), "AVX512")
    assert build.chosen_isa() == "avx512"  # torch cannot tell avx512_bf16: the plain AVX-512 build
    cpu(frozenset(), "DEFAULT")
    assert build.supported_isas() == ["scalar"]


def test_not_x86_runs_scalar(cpu, monkeypatch):
    cpu(AVX512_SERVER)
    monkeypatch.setattr(build, "x86", lambda: False)
    assert build.supported_isas() == ["scalar"]


def test_forcing_an_isa(cpu, monkeypatch):
    cpu(AVX512_SERVER)
    for isa in ("avx2", "scalar", "AVX512", " auto "):
        monkeypatch.setenv(build.ISA_ENV_VAR, isa)
        assert build.chosen_isa() == ("avx512" if isa.strip().lower() in ("auto", "avx512") else isa)
    described = build.describe()
    assert described["isa"] == "avx512" and described["cpu extras"] == "avx512_vnni"


def test_forcing_an_isa_the_cpu_lacks_is_refused_in_one_line(cpu, monkeypatch):
    cpu(AVX2_LAPTOP)
    monkeypatch.setenv(build.ISA_ENV_VAR, "avx512")
    with pytest.raises(BestiaryError, match=r"BESTIARY_CPU_ISA=avx512: this CPU lacks avx512f, avx512bw, avx512vl"):
        build.chosen_isa()
    with pytest.raises(BestiaryError, match="BESTIARY_CPU_ISA=avx512"):
        build.library()  # what every op asks first: the refusal reaches the user
    assert build.describe()["isa"] == "refused"
    monkeypatch.setenv(build.ISA_ENV_VAR, "sse9")
    with pytest.raises(BestiaryError, match="expected one of auto, avx512bf16, avx512, avx2, scalar"):
        build.chosen_isa()
    with pytest.raises(BestiaryError, match="this CPU runs avx2, scalar"):
        build.library_for("avx512")


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
def test_forced_isa_loads_that_build(monkeypatch):
    """The real library for each ISA this CPU runs: bst_isa() says which build it is."""
    try:
        for isa in build.supported_isas():
            monkeypatch.setenv(build.ISA_ENV_VAR, isa)
            build.library.cache_clear()
            assert build.library().bst_isa() == build.ISAS[isa].code
    finally:
        build.library.cache_clear()


def _cli(*args: str, isa: str) -> subprocess.CompletedProcess:
    env = {**os.environ, build.ISA_ENV_VAR: isa}
    return subprocess.run([sys.executable, "-m", "bestiary.core.cli", *args], capture_output=True, text=True, env=env,
                          check=False)


def test_inspect_shows_the_chosen_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM"}))
    forced = build.supported_isas()[-1]  # scalar: every CPU runs it
    result = _cli("inspect", str(tmp_path), isa=forced)
    assert result.returncode == 0, result.stderr
    assert "CPU kernels" in result.stdout and f"forced by {build.ISA_ENV_VAR}" in result.stdout
    auto = _cli("inspect", str(tmp_path), isa="auto")
    assert build.supported_isas()[0] in auto.stdout and "best the CPU runs" in auto.stdout


def test_unknown_isa_is_a_user_error_at_run(tmp_path):
    pytest.importorskip("transformers")
    from tiny_llama import make_tiny_llama

    from bestiary.core.cli.main import main

    src = make_tiny_llama(tmp_path)
    assert main(["convert", "--model_dir", str(src), "--output_dir", str(tmp_path / "ckpt")]) == 0
    assert main(["build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "engine")]) == 0
    result = _cli("run", "--engine_dir", str(tmp_path / "engine"), "--input_ids", "1,2,3", "--max_output_len", "3",
                  isa="avx10")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert "BESTIARY_CPU_ISA=avx10: expected one of" in result.stderr.strip().splitlines()[-1]


def test_kernels_build_where_a_compiler_is():
    """Bug: a kernels.c that did not compile made build.library() None, and the kernel test modules
    skipped as if no compiler were there (the suite stayed green on the torch references). Every
    ISA this CPU runs must build wherever a compiler is."""
    if build.compiler() is None or not build.enabled():
        pytest.skip("no C compiler (or BESTIARY_CPU_KERNELS=off)")
    for isa in build.supported_isas():
        assert build.library_for(isa) is not None, f"kernels.c did not build for {isa} (see the warning)"
