"""bestiary.core.kernels: every op of a step, as Triton kernels, compiled CPU kernels and torch references.

- `dispatch`: the one entry point layers call; it picks Triton for CUDA tensors, the compiled CPU
  kernels (`cpu/`) where they apply, else the torch reference (BESTIARY_KERNELS overrides).
- the Triton families (`dispatch.FAMILIES`: norms, rotary, activations, attention, moe, woq_gemm,
  lora, sampling): a private kernel, its launcher and the torch reference side by side; they import
  triton, so `dispatch` loads a family on its first call, never at import.
- triton-free: `metadata` (AttentionMetadata, one step's packed batch), `attention_window` (which
  keys a query sees under a window), `attention_ref`, `activations_ref`, `sampling_ref` (the torch
  references other layers call), `kv_codes` (INT8 / FP8 KV pool codes), `cpu/` (the C kernels:
  `build`, `ops`, `malloc`, kernels.c).

Layer 1 of the core (docs/architecture.md). May import: format.
"""
