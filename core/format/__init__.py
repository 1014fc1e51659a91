"""bestiary.core.format: what a checkpoint or engine directory holds, and what every layer shares.

The checkpoint schema (`config`, `hf_config`: HF config readers), the engine's build limits
(`build_config`), checkpoint and engine directories on disk (`checkpoint`, `output_dir`), the packed
int8 / int4 / fp8 weight layouts and their quantizers (`packing`), user-facing errors (`errors`) and
the per-user cache (`cache`).
Only `checkpoint` and `packing` import torch, so the CLI can read configs and build its flags without it.

Layer 0 of the core (docs/architecture.md). May import: nothing of bestiary.
"""
