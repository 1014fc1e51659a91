"""Phi-3 / Phi-3.5 / Phi-4 parity rows: every case of tests/models/test_phi3.py (PHI3) against transformers,
measured as benchmarks/qwen3_parity.py measures (its `measure`: prefill + 16 greedy decode steps, greedy tokens,
tp 2 against transformers and tp 1's tokens, W8A16 / W4A16 round to nearest in groups of 32).

Usage: python benchmarks/phi3_parity.py. Runs on the CPU in about a minute.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_parity import REPO, measure  # noqa: E402


def main() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    __import__("sys_path").add()  # the test modules (tests/models)
    import test_phi3

    header = ["architecture", "case", "max \\|diff\\|", "max \\|ref\\|", "bound", "greedy (16)",
              "tp 2: max \\|diff\\|, greedy vs tp 1", "W8A16", "W4A16"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, case in test_phi3.PHI3.items():
        with tempfile.TemporaryDirectory() as tmp:
            cells = measure("Phi3ForCausalLM", case, Path(tmp))
            print("| " + " | ".join(["Phi3ForCausalLM", name, *cells]) + " |", flush=True)


if __name__ == "__main__":
    main()
