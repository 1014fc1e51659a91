"""Gemma 2 and Gemma 3 parity rows: every case of tests/models/test_gemma2.py / test_gemma3.py against transformers.

The cells are benchmarks/qwen3_parity.py's `measure` (the same columns as the Qwen3 table of docs/models.md):
max |ours - HF| over the 12-token prefill and 16 greedy decode steps (past the window of 4), max |HF|, the kit's
bound; greedy tokens vs HF's argmax chain; a tp 2 engine's max |ours - HF| and its greedy tokens vs tp 1's;
W8A16 / W4A16 (round to nearest, groups of 32) max |quantized - HF| / max |HF| over the prefill.

Usage: python benchmarks/gemma_parity.py. Runs on the CPU in about a minute.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cases() -> dict[str, dict]:
    """architecture -> {case name: case} from the test modules."""
    sys.path.insert(0, str(REPO / "tests"))
    __import__("sys_path").add()  # the test modules (tests/models)
    import test_gemma2
    import test_gemma3

    return {"Gemma2ForCausalLM": test_gemma2.GEMMA2, "Gemma3ForCausalLM": test_gemma3.GEMMA3}


def main() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from qwen3_parity import print_table

    print_table(cases())


if __name__ == "__main__":
    main()
