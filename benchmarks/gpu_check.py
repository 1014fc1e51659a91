"""The whole GPU device check in one command: `make gpu-check OUT=dir` (or python benchmarks/gpu_check.py DIR).

Sections, in order, each in its own process with its own time box (a hang in one loses only that
one), all inside one overall budget (--budget, default 290 s):

    env             the device, driver, torch and triton versions
    install         the carried wheels (.whl/: what bestiary needs beyond the GPU image, WHEELS) into
                    a site dir, and bestiary itself as a link to this tree plus its entry points
    kernels         tests/kernels compiled on CUDA (BESTIARY_KERNEL_TEST_DEVICE=cuda): every Triton
                    kernel against its torch reference, each dtype and shape class; the table of
                    kernel x dtype with pass/fail and the worst max error over its bound
    parity          benchmarks/gpu_parity.py: every family, fp32 logits and bf16 greedy against
                    transformers on the same GPU
    perf            benchmarks/gpu_perf.py: TinyLlama-1.1B's shape, bestiary vs transformers eager vs
                    the measured copy bandwidth and matmul rate
    gpu-tests       pytest -m gpu (the test modules that carry the marker)
    kernel-timings  benchmarks/kernels.py at LLaMA-7B shapes, bf16

DIR receives two files, rewritten as each section ends: summary.json (each section's status, time
and parsed details) and gpu-check.log (each section's output). --dry-run (no GPU needed; CI runs it)
prints the plan and checks that WHEELS covers every runtime requirement of bestiary the GPU image
lacks (IMAGE_PACKAGES), and exits 1 when one is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
WHEEL_DIR = REPO / ".whl"
# What the GPU image has (the device tool's package list of its 'cuda' image, as normalized names).
IMAGE_PACKAGES = REPO / "benchmarks" / "gpu_image_packages.txt"
# The wheels that travel: bestiary's runtime requirements the image lacks, pinned (python 3.12, manylinux x86_64).
WHEELS = {"pydantic": "2.14.4", "pydantic-core": "2.50.5", "annotated-types": "0.8.0",
          "typing-inspection": "0.4.5", "typing-extensions": "4.16.0", "gguf": "0.19.0", "llguidance": "1.9.1"}
DOWNLOAD = ("python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
            "--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "
            "--platform manylinux2014_x86_64 "
            "-d .whl")


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --- the wheel list ---------------------------------------------------------------------------


def runtime_requirements() -> list[str]:
    """pyproject's [project] dependencies that apply on Linux (names only)."""
    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return [normalize(r.name) for r in reqs if r.marker is None or r.marker.evaluate({"sys_platform": "linux"})]


def missing_closure(image: set[str]) -> dict[str, list[str]]:
    """Every distribution bestiary needs at run time that the image lacks -> who needs it. Walks the
    requirements of the installed distributions (here), stopping at what the image has."""
    from packaging.requirements import Requirement

    need: dict[str, list[str]] = {}
    todo = [(name, "bestiary") for name in runtime_requirements()]
    while todo:
        name, by = todo.pop()
        if name in image or name in need:
            continue
        need[name] = [by]
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": "", "sys_platform": "linux"}):
                todo.append((normalize(req.name), name))
    return need


def image_packages() -> set[str]:
    return {normalize(line.strip()) for line in IMAGE_PACKAGES.read_text().split(",") if line.strip()}


def check_wheels() -> list[str]:
    """Problems with WHEELS: a needed distribution it lacks; a wheel of .whl/ (when present) off the list."""
    problems = [f"{name} (needed by {', '.join(by)}) is missing from WHEELS: add it, then {DOWNLOAD} {name}==VERSION"
                for name, by in sorted(missing_closure(image_packages()).items()) if name not in WHEELS]
    if WHEEL_DIR.is_dir():
        have = {normalize(w.name.split("-")[0]): w.name.split("-")[1] for w in WHEEL_DIR.glob("*.whl")}
        problems += [f".whl/ lacks {n}=={v}: {DOWNLOAD} {n}=={v}" for n, v in WHEELS.items() if have.get(n) != v]
    return problems


# --- install ----------------------------------------------------------------------------------


def entry_points_txt() -> str:
    """bestiary's entry points (pyproject) in a dist-info's entry_points.txt format."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    return "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())


def link_bestiary(site: Path) -> None:
    """`import bestiary` from this tree, with its entry points (the built-in architectures, the pytest
    plugin) visible to importlib.metadata: a link and a dist-info, no build."""
    site.mkdir(parents=True, exist_ok=True)
    link = site / "bestiary"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(REPO, target_is_directory=True)
    info = site / "bestiary-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bestiary\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(entry_points_txt())


def install(site: Path) -> dict:
    """The carried wheels into `site`, then bestiary linked (install section)."""
    wheels = sorted(str(w) for w in WHEEL_DIR.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
    link_bestiary(site)
    return {"wheels": [Path(w).name for w in wheels]}


# --- sections ---------------------------------------------------------------------------------


@dataclass
class Section:
    """One step of the check: a command, its time box, and how its details are read back."""

    name: str
    seconds: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    details: Callable[[], dict] | None = None


def gpu_test_files() -> list[str]:
    """The test modules that carry the gpu marker."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())


def sections(work: Path, site: Path) -> list[Section]:
    py = sys.executable
    xdist = ["-n", "8"] if importlib.util.find_spec("xdist") else []
    errors, junit = work / "kernel_errors.jsonl", work / "kernels.xml"
    return [
        Section("env", 20, [py, "-c", ENV_SCRIPT]),
        Section("install", 60, [py, str(Path(__file__).resolve()), "--install", str(site)]),
        Section("kernels", 110, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels",
                                 "--ignore=tests/kernels/cpu", f"--junitxml={junit}", *xdist],
                {"BESTIARY_KERNEL_TEST_DEVICE": "cuda", "BESTIARY_KERNEL_ERRORS": str(errors)},
                lambda: kernel_table(junit, errors)),
        Section("parity", 80, [py, "benchmarks/gpu_parity.py", str(work / "parity.json"), "--all-cases"],
                details=lambda: {"rows": read_json(work / "parity.json")}),
        Section("perf", 150, [py, "benchmarks/gpu_perf.py", str(work / "perf.json")],
                details=lambda: read_json(work / "perf.json")),
        Section("gpu-tests", 60, [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *gpu_test_files(),
                                  f"--junitxml={work / 'gpu_tests.xml'}"],
                details=lambda: junit_cases(work / "gpu_tests.xml")),
        Section("kernel-timings", 45, [py, "benchmarks/kernels.py", "--dtype", "bfloat16", "--tokens", "1,16,64"]),
    ]


ENV_SCRIPT = """
import shutil, subprocess, sys, torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
"""


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def junit_cases(path: Path) -> dict:
    """Counts of a junit file's cases by outcome, and the failures' first lines."""
    if not path.is_file():
        return {}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ET.parse(path).iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failures.append(f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:300]}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts | {"failures": failures[:60]}


DTYPES = ("bfloat16", "float16", "float32")


def kernel_key(classname: str, name: str, dtype: str | None = None) -> tuple[str, str]:
    """(kernel test, dtype) of a junit case or an error row: 'attention::test_decode', 'bfloat16'.
    The dtype is the one the test recorded, else read from the parameters ('-': none there)."""
    module = classname.rsplit(".", 1)[-1].removeprefix("test_kernels_").removeprefix("test_")
    base, _, params = name.partition("[")
    dtype = dtype or next((d for d in DTYPES if re.search(rf"(^|[^a-z]){d}", params)), "-")
    return f"{module}::{base}", dtype


def kernel_table(junit: Path, errors: Path) -> dict:
    """kernel test x dtype -> passed / failed / skipped, worst max error and its ratio to the bound."""
    table: dict[str, dict] = {}
    rows = [json.loads(line) for line in errors.read_text().splitlines()] if errors.is_file() else []
    dtypes = {(Path(e["test"].partition("::")[0]).stem, e["test"].partition("::")[2]): e["dtype"] for e in rows}
    if junit.is_file():
        for case in ET.parse(junit).iter("testcase"):
            module, name = case.get("classname", "").rsplit(".", 1)[-1], case.get("name", "")
            key = "|".join(kernel_key(module, name, dtypes.get((module, name))))
            row = table.setdefault(key, {"passed": 0, "failed": 0, "skipped": 0})
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            outcome = "failed" if bad is not None else "skipped" if case.find("skipped") is not None else "passed"
            row[outcome] += 1
            if bad is not None:
                row.setdefault("failures", []).append(f"{case.get('name')}: {(bad.get('message') or '')[:200]}")
    for e in rows:
        path, _, name = e["test"].partition("::")
        test, dtype = kernel_key(Path(path).stem, name, e["dtype"])
        row = table.setdefault(f"{test}|{dtype}", {"passed": 0, "failed": 0, "skipped": 0})
        ratio = e["max_err"] / e["bound"] if e["bound"] else float("inf")
        if ratio == ratio and ratio >= row.get("worst_ratio", -1.0):  # NaN (non-finite output) is a failure
            row |= {"worst_ratio": ratio, "max_err": e["max_err"], "bound": e["bound"]}
        elif ratio != ratio:
            row["non_finite"] = True
    return {"table": table, **junit_cases(junit)}


# --- running ----------------------------------------------------------------------------------


def run_section(s: Section, timeout: float, env: dict[str, str], log: Path) -> dict:
    """Run one section in its own process group, killed at `timeout`; its output appended to `log`."""
    start = time.perf_counter()
    out = log.with_suffix(f".{s.name}.tmp")
    with open(out, "w") as f:
        proc = subprocess.Popen(s.argv, cwd=REPO, env=env | s.env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            status = "pass" if rc == 0 else "fail"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, status = None, "timeout"
    text = out.read_text(errors="replace")
    out.unlink()
    with open(log, "a") as f:
        f.write(f"\n===== {s.name}: {status} (rc {rc}, {time.perf_counter() - start:.1f} s of {timeout:.0f}) =====\n{text}")
    row = {"status": status, "rc": rc, "seconds": round(time.perf_counter() - start, 1), "tail": text[-1500:]}
    if s.details is not None:
        try:
            row["details"] = s.details()
        except Exception as err:  # unreadable details are reported, not fatal
            row["details_error"] = f"{type(err).__name__}: {err}"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path(".gpu-check"),
                        help="folder for summary.json and gpu-check.log (default .gpu-check)")
    parser.add_argument("--budget", type=float, default=290, help="seconds for all sections together (default 290)")
    parser.add_argument("--only", default="", help="comma-separated section names to run (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and check the wheel list; run nothing")
    parser.add_argument("--install", type=Path, metavar="SITE", help=argparse.SUPPRESS)  # the install section itself
    args = parser.parse_args(argv)
    if args.install:
        print(json.dumps(install(args.install)))
        return 0
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "bestiary-gpu-check"
    site = work / "site"
    plan = [s for s in sections(work, site) if not args.only or s.name in args.only.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path, log = args.out / "summary.json", args.out / "gpu-check.log"
    summary: dict = {"budget_s": args.budget, "dry_run": args.dry_run, "sections": {}}
    if args.dry_run:
        problems = check_wheels()
        summary |= {"wheel_problems": problems, "wheels": WHEELS,
                    "plan": [{"name": s.name, "seconds": s.seconds, "argv": s.argv, "env": s.env} for s in plan]}
        summary_path.write_text(json.dumps(summary, indent=1))
        for s in plan:
            print(f"{s.name:15s} {s.seconds:4d} s  {' '.join(s.argv)[:150]}")
        print(f"time boxes {sum(s.seconds for s in plan)} s within a budget of {args.budget:.0f} s")
        for p in problems:
            print("wheels:", p)
        return 1 if problems else 0
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log.write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    deadline = time.perf_counter() + args.budget
    for s in plan:
        left = deadline - time.perf_counter()
        if left < 5:
            summary["sections"][s.name] = {"status": "skipped", "reason": "budget spent"}
        else:
            summary["sections"][s.name] = run_section(s, min(s.seconds, left), env, log)
        summary_path.write_text(json.dumps(summary, indent=1, default=str))
        print(f"{s.name:15s} {summary['sections'][s.name]['status']:8s} {summary['sections'][s.name].get('seconds', '')}",
              flush=True)
    return 0 if all(v["status"] == "pass" for v in summary["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
