"""Issue 46 items 8, 9 and 10b: build refuses limits run cannot use, the memory checks size the pool as
allocated and read cgroup and rlimit limits, an allocation that fails anyway is one line, and an
unwritable cache is one warning line. Each test is a reproduction of the issue on the tiny LLaMA."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from cli_errors import one_line  # noqa: E402
from tiny_llama import make_tiny_engine  # noqa: E402

from bestiary.core.cli.main import main  # noqa: E402
from bestiary.core.convert import memory  # noqa: E402
from bestiary.core.format.resources import GiB, Limit  # noqa: E402

TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head 16, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_engine(tmp_path_factory.mktemp("limits"), tokenizer=True)


def build(tiny: Path, out: Path, *flags: str) -> list[str]:
    return ["build", "--checkpoint_dir", str(tiny / "ckpt"), "--output_dir", str(out), *flags]


def run(engine: Path, *extra: str) -> list[str]:
    return ["run", "--engine_dir", str(engine), "--input_ids", "1,2", "--max_output_len", "2", *extra]


def edited_engine(tiny: Path, tmp_path: Path, **build_config: object) -> Path:
    """A copy of the tiny engine whose config.json's build_config has these values (an engine an
    earlier build wrote)."""
    engine = tmp_path / "edited"
    shutil.copytree(tiny / "engine", engine)
    config = json.loads((engine / "config.json").read_text())
    config["build_config"].update(build_config)
    (engine / "config.json").write_text(json.dumps(config))
    return engine


# --- item 8: build writes engines run cannot load ------------------------------------------------
def test_build_refuses_max_seq_len_1(tiny, tmp_path, capsys):
    """`build --max_seq_len 1` exited 0, then every run failed: max_input_len 0."""
    out = tmp_path / "engine"
    one_line(capsys, build(tiny, out, "--max_seq_len", "1"), 2, "--max_seq_len 1", "expected at least 2")
    assert not out.exists()
    assert main(build(tiny, out, "--max_seq_len", "2")) == 0  # the smallest engine that runs, runs
    assert main(["run", "--engine_dir", str(out), "--input_ids", "1", "--max_output_len", "1"]) == 0


@pytest.mark.parametrize("value,words", [
    (True, ["max_position_embeddings", "expected a positive integer (got True)"]),
    (1, ["max_seq_len 1 (the model's max_position_embeddings)", "expected at least 2"]),
    ("128", ["max_position_embeddings", "(got '128')"]),
])
def test_build_refuses_max_position_embeddings_run_cannot_use(tiny, tmp_path, capsys, value, words):
    """`"max_position_embeddings": true` was taken as 1 and built an engine of max_seq_len 1."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny / "ckpt", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["max_position_embeddings"] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "engine"
    one_line(capsys, ["build", "--checkpoint_dir", str(ckpt), "--output_dir", str(out)], 2, *words)
    assert not out.exists()


@pytest.mark.parametrize("limits,words", [
    ({"max_seq_len": 1, "max_input_len": 0}, ["field 'build_config.max_input_len'"]),
    ({"max_seq_len": 1, "max_input_len": None}, ["built with --max_seq_len 1", "expected at least 2"]),
    ({"tokens_per_block": 10**9}, ["config.json: built with --tokens_per_block 1000000000", "expected 1 to 1024"]),
])
def test_run_refuses_an_engine_an_earlier_build_wrote_with_bad_limits(tiny, tmp_path, capsys, limits, words):
    one_line(capsys, run(edited_engine(tiny, tmp_path, **limits)), 2, *words)


# --- item 9: the pool as allocated, against the limits this process has ---------------------------
def test_build_refuses_a_block_larger_than_run_can_allocate(tiny, tmp_path, capsys):
    """--tokens_per_block 1000000000 passed build's check (a pool of 768 tokens), then run asked for 256 GB."""
    out = tmp_path / "engine"
    one_line(capsys, build(tiny, out, "--tokens_per_block", "1000000000"), 2,
             "--tokens_per_block 1000000000", "expected 1 to 1024")
    assert not out.exists()
    assert main(build(tiny, out, "--tokens_per_block", "1024")) == 0
    assert main(run(out)) == 0


def test_build_checks_the_pool_rounded_up_to_whole_blocks(tiny, tmp_path, capsys, monkeypatch):
    """100 tokens fit the limit; one whole block of 1,024 does not: the check names --tokens_per_block."""
    weights = (tiny / "ckpt" / "rank0.safetensors").stat().st_size
    monkeypatch.setattr(memory, "memory_capacity",
                        lambda: Limit(weights + 200 * TINY_BYTES_PER_TOKEN, "cgroup memory.max of /job"))
    out = tmp_path / "engine"
    assert main(build(tiny, out, "--max_tokens_in_paged_kv_cache", "100", "--tokens_per_block", "4")) == 0
    shutil.rmtree(out)
    capsys.readouterr()
    err = one_line(capsys, build(tiny, out, "--max_tokens_in_paged_kv_cache", "100", "--tokens_per_block", "1024"),
                   1, "KV cache of 1,024 tokens (1 block of 1024) needs 512.0 KiB", "(cgroup memory.max of /job)",
                   "lower --tokens_per_block", "--skip_memory_check")
    assert not out.exists(), err


def limited(soft_as: int):
    """A subprocess preexec_fn: RLIMIT_AS (ulimit -v) of `soft_as` bytes."""
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (soft_as, resource.RLIM_INFINITY))


def bestiary(args: list[str], soft_as: int | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bestiary", *args], capture_output=True, text=True, check=False,
                          timeout=300, preexec_fn=limited(soft_as) if soft_as else None, env={**os.environ, **env})


def test_a_ulimit_is_honoured_at_build_and_at_run(tiny, tmp_path):
    """RLIMIT_AS 3 GiB: a 3.8 GiB pool passed build's check (RAM only) and run died in the allocator
    ("internal error: RuntimeError: ... DefaultCPUAllocator")."""
    engine = tmp_path / "engine"
    tokens = str(8_000_000)  # 8e6 * 512 bytes = 3.8 GiB
    result = bestiary(build(tiny, engine, "--max_tokens_in_paged_kv_cache", tokens), soft_as=3 * GiB)
    assert result.returncode == 1 and not engine.exists(), result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "KV cache of 8,000,000 tokens" in line and "RLIMIT_AS (ulimit -v)" in line, line
    assert main(build(tiny, engine, "--max_tokens_in_paged_kv_cache", tokens, "--skip_memory_check")) == 0
    result = bestiary(run(engine), soft_as=3 * GiB)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "KV cache of 8,000,000 tokens needs 3.8 GiB" in line and "RLIMIT_AS (ulimit -v)" in line, line


def test_an_allocation_that_fails_anyway_is_one_line_exit_1(tiny, monkeypatch, capsys):
    """Past the checks (lazy pages, overcommit) torch's allocator may still refuse: not an internal error."""
    from bestiary.core.runtime import engine as engine_module

    def allocator_refuses(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 256000000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(engine_module, "load_by_layer", allocator_refuses)
    one_line(capsys, run(tiny / "engine"), 1, "out of memory: allocating 256,000,000,000 bytes (238.4 GiB) failed",
             "is available to this process", "--max_batch_size")
    monkeypatch.setattr(engine_module, "load_by_layer", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
    one_line(capsys, run(tiny / "engine"), 1, "out of memory: an allocation failed", "available")


# --- item 10b: an unwritable cache ---------------------------------------------------------------
def test_an_unwritable_cache_is_one_warning_line(tiny, tmp_path):
    """`run` with BESTIARY_CACHE where nothing can be written printed a 2-line UserWarning."""
    from bestiary.core.kernels.cpu import build as kernels_build

    if kernels_build.compiler() is None or not kernels_build.enabled():
        pytest.skip("no C compiler (or BESTIARY_CPU_KERNELS=off): nothing is built into the cache")
    result = bestiary(run(tiny / "engine"), BESTIARY_CACHE="/proc/bestiary-cache")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    warned = [x for x in lines if "CpuKernelsWarning" in x]
    assert len(warned) == 1 and "/proc/bestiary-cache" in warned[0] and "BESTIARY_CACHE" in warned[0], lines
    assert len(lines) == 2 and lines[1].startswith("[bestiary]"), lines  # the warning and the stats line only
