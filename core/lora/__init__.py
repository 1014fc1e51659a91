"""bestiary.core.lora: HF PEFT LoRA adapters, per request, many in one batch.

- `modules`: the TensorRT-LLM LoRA module names and ids (attn_qkv 0 ... mlp_router 17) and
  the canonical layer each one adapts.
- `peft_config`: adapter_config.json as a pydantic model; unsupported PEFT features refused.
- `adapter`: an adapter dir -> `LoraAdapter` (per canonical linear: A, B, scaling), checked
  against the model (targets, architecture, shapes) before / while reading its weights.
- `batch`: one step's adapters stacked per linear (`AdapterStack`) and the step's
  `StepLora`, the `LoraDelta` the linear layers call (meta.lora).
- `store`: `LoraRequest(name, path=, weights=, config=)`: a request's adapter (task id) and what
  its first request brings.
- `trtllm_tensors`: TensorRT-LLM's per-request LoraWeights [M, D*Hi + Ho*D] / LoraConfig [M, 3] tensors.
- `trtllm_convert`: PEFT dir <-> TensorRT-LLM LoRA tensors (`bestiary convert --lora_dir`).
- `cache`: the two-level (host / device) LoRA cache with byte budgets and LRU eviction of
  adapters no request holds.
- `bundle`: adapters bundled in an engine dir (`bestiary build --lora_dir`).
- `ranks`: a tp > 1 step's adapters sent to and placed on every rank.

Layer 3 of the core (docs/architecture.md). May import: format, plugins, sources, kernels, registry,
layers.
"""
