"""benchmarks/gpu_check.py on a machine without a GPU: the dry run (what CI can check so the device
run does not rot between GPU windows), the wheel list, the bestiary link, the kernel table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

SECTIONS = ["env", "install", "kernels", "parity", "perf", "gpu-tests", "kernel-timings"]


def test_dry_run_plans_every_section_and_the_wheels_cover_the_image(tmp_path):
    assert gpu_check.main([str(tmp_path), "--dry-run"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["name"] for s in summary["plan"]] == SECTIONS
    assert summary["wheel_problems"] == []
    kernels = next(s for s in summary["plan"] if s["name"] == "kernels")
    assert kernels["env"]["BESTIARY_KERNEL_TEST_DEVICE"] == "cuda" and "tests/kernels" in kernels["argv"]
    for name in ("gpu_parity.py", "gpu_perf.py"):  # the scripts the plan runs exist
        assert (REPO / "benchmarks" / name).is_file()


def test_the_wheel_check_names_a_missing_requirement(monkeypatch):
    """pydantic is not on the GPU image: without its wheel the check names it and who needs it."""
    monkeypatch.setattr(gpu_check, "WHEELS", {k: v for k, v in gpu_check.WHEELS.items() if k != "pydantic-core"})
    monkeypatch.setattr(gpu_check, "WHEEL_DIR", REPO / "no-such-dir")
    problems = gpu_check.check_wheels()
    assert len(problems) == 1 and problems[0].startswith("pydantic-core (needed by pydantic)")


def test_missing_closure_stops_at_the_image():
    closure = gpu_check.missing_closure(gpu_check.image_packages())
    assert {"pydantic", "pydantic-core", "gguf"} <= set(closure)
    assert not {"torch", "triton", "numpy", "safetensors", "rich"} & set(closure)


def test_link_bestiary_writes_every_entry_point(tmp_path):
    gpu_check.link_bestiary(tmp_path)
    assert (tmp_path / "bestiary").resolve() == REPO
    text = (tmp_path / "bestiary-0.1.0.dist-info" / "entry_points.txt").read_text()
    for name in ("llama = bestiary.models.llama", "exaone4 = bestiary.models.exaone4",
                 "bestiary = bestiary.core.cli:main", "[pytest11]"):
        assert name in text
    gpu_check.link_bestiary(tmp_path)  # a second run replaces the link


@pytest.mark.parametrize("name,expected", [
    ("test_int4[torch.bfloat16-True-64-3]", ("woq_gemm::test_int4", "bfloat16")),
    ("test_decode[dtype1-4-2]", ("woq_gemm::test_decode", "-")),
    ("test_x[torch.float16]", ("woq_gemm::test_x", "float16")),
    ("test_x[torch.float32]", ("woq_gemm::test_x", "float32")),
])
def test_kernel_key(name, expected):
    assert gpu_check.kernel_key("tests.kernels.test_kernels_woq_gemm", name) == expected


def test_kernel_table_joins_outcomes_and_errors(tmp_path):
    junit = tmp_path / "k.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="tests.kernels.test_kernels_norms" name="test_rms[torch.bfloat16-3]"/>'
                     '<testcase classname="tests.kernels.test_kernels_norms" name="test_rms[torch.bfloat16-5]">'
                     '<failure message="too far"/></testcase></testsuite></testsuites>')
    errors = tmp_path / "e.jsonl"
    errors.write_text(json.dumps({"test": "tests/kernels/test_kernels_norms.py::test_rms[torch.bfloat16-3]",
                                  "dtype": "bfloat16", "max_err": 0.01, "bound": 0.02}) + "\n")
    out = gpu_check.kernel_table(junit, errors)
    row = out["table"]["norms::test_rms|bfloat16"]
    assert (row["passed"], row["failed"], row["worst_ratio"]) == (1, 1, 0.5)
    assert out["failed"] == 1 and "too far" in out["failures"][0]


def _script(args: list[str], tmp_path) -> dict | list:
    import subprocess

    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, *args, str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_parity_section_runs_on_the_cpu(tmp_path):
    """The parity script's code paths (convert, fp32 logits, bf16 greedy through LLM) on one family."""
    rows = _script(["benchmarks/gpu_parity.py", "--device", "cpu", "--only", "LlamaForCausalLM", "--all-cases"], tmp_path)
    assert [r["case"] for r in rows] == ["gqa_untied", "mqa_bias_llama3"]
    assert all(r["fp32_pass"] and r["bf16_pass"] and r["fp32_diff"] < 1e-4 for r in rows)


def test_perf_section_runs_on_the_cpu(tmp_path):
    """The perf script end to end on a 2-layer toy model: every part measured, none failed."""
    data = _script(["benchmarks/gpu_perf.py", "--device", "cpu", "--small", "--new-tokens", "8", "--prefill", "64",
                    "--batch", "4"], tmp_path)
    parts = ["limits", "source", "hf", "bf16_b1", "bf16_step", "bf16_b64", "prefill", "w8a16", "w4a16"]
    assert list(data) == parts and not [p for p in parts if "error" in data[p]]
    assert data["bf16_b1"]["tok_s"] > 0 and data["w4a16"]["bytes_per_token"] < data["bf16_b1"]["bytes_per_token"]
