"""The parity helpers, imported by test modules as `import parity` (pytest puts tests/ on sys.path).

They live in the package, `bestiary.testing.parity`, so third-party plugins get them installed.
"""

from bestiary.testing.parity import (  # noqa: F401 - re-exported
    EngineRunner,
    convert_and_load,
    greedy_mismatch,
    hf_greedy,
    hf_logits,
    prefill_and_decode_diffs,
    reassemble_checkpoint,
    reinit_,
    save_hf,
    tolerance,
)
