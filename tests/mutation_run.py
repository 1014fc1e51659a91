"""`make mutation`: mutmut on the numerics-heavy modules, one module at a time (not run in CI).

mutmut copies the code it mutates into ./mutants and imports it from there, so it needs the
package under its import name: each run works in a staging directory `.mutation/<name>/` holding
a copy of the repository as `bestiary/` and a setup.cfg naming the module and its fast tests.
The score per module goes to `.mutation/scores.txt`; survivors are listed by
`cd .mutation/<name> && mutmut results` and `mutmut show <mutant>`. docs/testing.md lists the
survivors of the last full run with the reason each one stays.

    python tests/mutation_run.py [name ...]     (default: every module below)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / ".mutation"

# name -> (module paths inside the package, the fast tests that cover them)
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "sampling": (["core/runtime/sampling.py"], ["tests/test_sampling.py"]),
    "beam": (["core/runtime/beam.py"], ["tests/test_beam.py", "-m", "not slow"]),
    "kv_cache": (["core/runtime/kv_cache.py"], ["tests/test_kv_pool.py", "tests/test_scheduler.py",
                                                "tests/test_quant_kv.py"]),
    "packing": (["core/quant/packing.py"], ["tests/test_quant.py", "-m", "not slow"]),
    "loader": (["core/convert/loader.py"], ["tests/test_checkpoint.py", "tests/test_opt.py", "-k",
                                            "reassemble or strict or checkpoint or tied"]),
    "layers": (["core/layers/"], ["tests/test_llama_parity.py", "tests/test_cpu_matmul.py", "-m", "not slow"]),
    "kernels": (["core/kernels/"], ["tests/kernels/test_kernels_norms.py", "tests/kernels/test_kernels_rotary.py",
                                    "tests/kernels/test_kernels_activations.py", "tests/kernels/test_kernels_attention.py",
                                    "tests/kernels/test_kernels_moe.py", "tests/kernels/test_kernels_woq_gemm.py"]),
}


def single_threaded_env() -> dict[str, str]:
    """The environment for `mutmut run`: one OpenMP/MKL thread.

    mutmut forks each mutant's test run from a process that has already run torch; a fork of a
    process whose OpenMP thread pool is up deadlocks in the child's first parallel region, so
    every mutant would end as a CPU-time "timeout" (what the first full run showed). With one
    thread no pool is started and the forks run."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def stage(name: str) -> Path:
    """A fresh `.mutation/<name>/` with the repository as `bestiary/` and mutmut's setup.cfg."""
    paths, tests = MODULES[name]
    work = STAGE / name
    shutil.rmtree(work, ignore_errors=True)
    ignore = shutil.ignore_patterns(".git", ".mutation", "site", "build", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(ROOT, work / "bestiary", ignore=ignore)

    def listed(items: list[str]) -> str:  # setup.cfg lists: one item a line
        return "".join(f"\n    {item}" for item in items)

    selection = [f"bestiary/{t}" if t.startswith("tests/") else t for t in tests]
    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        f"source_paths ={listed([f'bestiary/{p}' for p in paths])}\n"
        f"also_copy ={listed(['bestiary/'])}\n"
        f"pytest_add_cli_args_test_selection ={listed(selection)}\n"
        f"pytest_add_cli_args ={listed(['-x', '-q', '-p', 'no:cacheprovider'])}\n"
    )
    return work


def score(work: Path) -> str:
    """'killed / total (percent)' from `mutmut results --all true`."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work,
                         capture_output=True, text=True, check=False).stdout
    states = re.findall(r":\s*(\w[\w ]*)$", out, flags=re.M)
    total, killed = len(states), sum(s == "killed" for s in states)
    return f"{killed} / {total} killed ({100 * killed / max(total, 1):.0f}%)"


def main(names: list[str]) -> int:
    STAGE.mkdir(exist_ok=True)
    for name in names or list(MODULES):
        work = stage(name)
        subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "2"], cwd=work, check=False,
                       env=single_threaded_env())
        line = f"{name}: {score(work)}"
        print(line)
        with open(STAGE / "scores.txt", "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
