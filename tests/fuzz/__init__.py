"""The fuzzer: seeded, mutated inputs of every kind through the `bestiary` CLI (docs/testing.md).

Each case starts from a tiny valid input (fuzz_base: an HF LLaMA dir with a tokenizer, its checkpoint
and engine, a SentencePiece and a byte-level BPE GGUF, a .flm written by `bestiary export`), mutates
one thing (fuzz_files, fuzz_binary, fuzz_templates, fuzz_flags) and runs one command on it in a
long-lived worker process (fuzz_worker, driven by fuzz_runner). A case fails on a traceback,
"internal error", an exit code other than 0 or 2, an exit-2 error of more than one line on stderr,
a hang past its time budget or memory past the worker's address-space limit.

    python -m tests.fuzz --cases 2000 --seed 0     # make fuzz
    python -m tests.fuzz --seed 0 --case 17        # one case again, alone, with its full output

Its modules import each other by name: this package's folder is put on sys.path here (pytest's
tests/sys_path.py does the same), and tests/helpers for the tiny model makers.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _folder in (HERE.parent / "helpers", HERE):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
