"""benchmarks/kernels.py: the CPU message, the peak table, the table's arithmetic, and every case
it times run once (shapes shrunk, on the test device) with the kernel matching its reference.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bestiary.core.kernels import dispatch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"
# Small shapes with the benchmark's structure: hidden divisible by the int4 group 128, block
# size 5 against a 23-token context, odd head and FFN counts.
TINY = dict(HIDDEN=128, HEADS=4, HEAD_DIM=32, FFN=96, GQA_KV_HEADS=1, CONTEXT=23, BLOCK_SIZE=5, PREFILL_SEQS=2,
            PREFILL_LEN=7, CHUNK_LEN=3, CHUNK_CONTEXT=9, ROPE_POSITIONS=64, MOE_FFN=48, LORA_SEGMENT=6, VOCAB=300)


@pytest.fixture
def bench(monkeypatch, device):
    """The benchmark script as a module, its shapes TINY and its device the test device."""
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    for name, value in {**TINY, "DEVICE": str(device)}.items():
        monkeypatch.setattr(module, name, value)
    return module


def test_cpu_machine_says_so_and_exits_0():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--rep", "5"], env={**env, "CUDA_VISIBLE_DEVICES": ""},
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "needs a CUDA device" in out.stdout and "nothing timed" in out.stdout


def test_bad_ops_is_a_usage_error():
    out = subprocess.run([sys.executable, str(SCRIPT), "--ops", "norms,flash"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 2 and "--ops flash: expected some of" in out.stderr


@pytest.mark.parametrize("name,label,gbps,tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 3350, 989),
    ("NVIDIA H100 PCIe", "H100 PCIe", 2000, 756),
    ("NVIDIA H100 NVL", "H100 NVL", 3900, 835),
    ("NVIDIA H200", "H200", 4800, 989),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 2039, 312),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 1555, 312),
    ("NVIDIA L40S", "L40S", 864, 362),
    ("NVIDIA L4", "L4", 300, 121),
])
def test_device_peak(bench, name, label, gbps, tflops):
    assert bench.device_peak(name) == bench.Peak(label, gbps, tflops)


def test_unknown_device_and_row_arithmetic(bench):
    assert bench.device_peak("NVIDIA GeForce RTX 3090") is None
    timing = bench.Timing("op", "shape", bytes=3.35e9, flops=0.5e12, triton_ms=1.0, torch_ms=2.5)  # 3350 GB/s
    cells = bench.row(timing, bench.device_peak("NVIDIA H100 80GB HBM3"))
    assert cells[2:] == ["1,000.0", "2,500.0", "2.50x", "3,350", "500.0", "100% mem"]
    flop_bound = bench.Timing("op", "s", bytes=1e6, flops=0.9e12, triton_ms=None, torch_ms=2.0)  # torch-only row
    assert bench.row(flop_bound, bench.device_peak("NVIDIA A100-SXM4-80GB"))[2:] == [
        "-", "2,000.0", "-", "0", "450.0", "144% flop"]
    assert bench.row(flop_bound, None)[-1] == "unknown"


def _outputs(result) -> list[torch.Tensor]:
    if result is None:
        return []
    return [result] if isinstance(result, torch.Tensor) else list(result)


def test_every_case_runs_and_matches(bench, device):
    """Each timed pair computes the same thing: out-of-place kernels against their reference."""
    assert set(bench.BUILDERS) == set(bench.FAMILIES)
    count = 0
    for fam in bench.FAMILIES:
        for case in bench.BUILDERS[fam](torch.float32, [1, 3], dispatch.family):
            assert case.bytes > 0 and case.flops >= 0, case
            ref = _outputs(case.torch())
            if case.triton is None:
                continue
            out = _outputs(case.triton())
            assert len(out) == len(ref), case.op
            for o, r in zip(out, ref):
                what = f"{case.op} {case.shape}"
                torch.testing.assert_close(o.cpu().to(r.dtype), r.cpu(), rtol=1e-4, atol=1e-4, msg=what)
            count += 1
    assert count >= 25


def test_main_prints_the_table(bench, monkeypatch, capsys):
    """main() past the CUDA check, on the test device with a wall-clock timer: the rich table and its peak."""
    import time

    def wall_ms(fn, rep):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "time_ms", wall_ms)
    assert bench.main(["--ops", "norms,woq_gemm", "--tokens", "1,3", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "H100 SXM: peak 3,350 GB/s HBM, 989 TFLOP/s" in out
    for op in ("rms_norm", "add + rms_norm", "woq int8 per-channel", "woq int4 g128 + zeros", "linear dense"):
        assert op in out, op
    assert "% mem" in out and "geometric-mean speedup of Triton over torch" in out
