"""Phi-3 / Phi-3.5 / Phi-4 parity rows: every case of tests/models/test_phi3.py (PHI3) against transformers,
measured as benchmarks/qwen3_parity.py measures (its `measure`: prefill + 16 greedy decode steps, greedy tokens,
tp 2 against transformers and tp 1's tokens, W8A16 / W4A16 round to nearest in groups of 32).

Usage: python benchmarks/phi3_parity.py. Runs on the CPU in about a minute.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_parity import REPO, print_table  # noqa: E402


def main() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    __import__("sys_path").add()  # the test modules (tests/models)
    import test_phi3

    print_table({"Phi3ForCausalLM": test_phi3.PHI3})


if __name__ == "__main__":
    main()
